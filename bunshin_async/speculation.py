"""Speculative tool execution: run likely tool calls while the model is still generating.

The agent loop holds a ``WorkspaceHandle`` (speculation may move the rollout into a committed fork) and runs each
turn through ``run_turn`` (or ``SpeculativeTurn`` to see results as they come)::

    from bunshin_async.speculation import Speculation, WorkspaceHandle, run_turn
    from speculator import default_speculation

    spec = default_speculation(group=task_id)             # predictors + cost-aware policy, shared by a group
    async with WorkspaceHandle(ws, own=False, salt=task_id) as handle:
        for turn in range(max_turns):
            stream = await client.chat.completions.create(..., stream=True)
            async with tap_openai_stream(stream, tools) as tap:
                outcome = await run_turn(tap, handle, tools, spec)     # spec=None: the plain path
            ...                                             # outcome.results in call order; handle.workspace

Predictors and policies live in the ``speculator`` package; this module only knows their Protocols. The turn's
planning is exported as pure functions (``Classified``, ``plan_launches``, ``proposals``, ``scores``) so that an
offline replay of recorded rollouts plans launches exactly as a live turn does, and ``tell_run`` tells the policy of
each run what a live turn tells it; ``chain_root`` and ``extend_chain`` make the ``PredictionContext.chain`` keys.
"""

from __future__ import annotations

from ._public import publish as _publish
from ._runtime._calls import (
    CallKey,
    Candidate,
    Launch,
    Policy,
    PredictionContext,
    Predictor,
    canonical_args,
    chain_root,
    extend_chain,
)
from ._runtime._handle import Executor, WorkspaceHandle
from ._runtime._metrics import BranchRecord, RolloutMetrics, TimelineEvent, TurnMetrics
from ._runtime._planning import Classified, plan_launches, proposals, scores
from ._runtime._results import CallResult, TurnOutcome
from ._runtime._speculation import BoundedPolicy, GroupSignal, LiveForks, Speculation
from ._runtime._telling import Ran, tell_run
from ._runtime._turn import SpeculativeTurn, run_turn

__all__ = [
    "BoundedPolicy",
    "BranchRecord",
    "CallKey",
    "CallResult",
    "Candidate",
    "Classified",
    "Executor",
    "GroupSignal",
    "Launch",
    "LiveForks",
    "Policy",
    "PredictionContext",
    "Predictor",
    "Ran",
    "RolloutMetrics",
    "Speculation",
    "SpeculativeTurn",
    "TimelineEvent",
    "TurnMetrics",
    "TurnOutcome",
    "WorkspaceHandle",
    "canonical_args",
    "chain_root",
    "extend_chain",
    "plan_launches",
    "proposals",
    "run_turn",
    "scores",
    "tell_run",
]

_publish(__name__, globals())
