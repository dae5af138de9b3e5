"""The turn runtime: one agent turn as a task graph (LLM stream, tap, speculative branches, commit)."""

from __future__ import annotations

from ._calls import CallKey, Candidate, Launch, Policy, PredictionContext, Predictor, canonical_args
from ._handle import Executor, WorkspaceHandle, WorkspaceSlot
from ._metrics import BranchRecord, RolloutMetrics, TimelineEvent, TurnMetrics
from ._turn import BoundedPolicy, CallResult, Speculation, SpeculativeTurn, TurnOutcome, run_turn

__all__ = [
    "BoundedPolicy",
    "BranchRecord",
    "CallKey",
    "CallResult",
    "Candidate",
    "Executor",
    "Launch",
    "Policy",
    "PredictionContext",
    "Predictor",
    "RolloutMetrics",
    "Speculation",
    "SpeculativeTurn",
    "TimelineEvent",
    "TurnMetrics",
    "TurnOutcome",
    "WorkspaceHandle",
    "WorkspaceSlot",
    "canonical_args",
    "run_turn",
]
