"""Issue #38 through the runtime: a rollout that committed a speculative fork prints the pids the plain loop prints
(`cmd & echo $!`). The fork's dump closed the main line's connection to the agent and the copy's first call opened
one; an agent that made a thread per connection took a pid for it there, and the experiment's oracle runs printed
another `PID: $!` than fork+cache (docs/concepts/workspace.md, the agent's threads)."""

from __future__ import annotations

from typing import Any

from bunshin_async import Workspace
from bunshin_async.speculation import BoundedPolicy, Speculation
from bunshin_async.tools import builtin_tools
from speculator import Rule, RulePredictor

from .agent_loop import agent_rollout
from .conftest import bash, final, trajectory

BACKGROUND = "sleep 100 >/dev/null 2>&1 & echo $!"


async def test_a_committed_fork_prints_the_pids_the_plain_loop_prints(serve: Any) -> None:
    traj = trajectory("pids", [bash("echo 0 > g", turn=0), bash("echo a > f", turn=1), bash(BACKGROUND, turn=2),
                               bash(BACKGROUND, turn=3), final()])  # fmt: skip
    # the write after the first call, predicted right: it runs in a fork (after a connection was open), committed
    rule = Rule(after="echo 0", then_tool="bash", then_args={"command": "echo a > f"}, probability=1.0,
                expected_seconds=1.0)  # fmt: skip
    spec = Speculation(predictors=[RulePredictor([rule])], policy=BoundedPolicy(), group=traj.task_id, early=True)
    tools = builtin_tools()
    async with serve([traj]) as client:
        async with Workspace() as ws:
            on = await agent_rollout(client, f"replay:{traj.key}", ws, tools, spec, task_id=traj.task_id)
        async with Workspace() as ws:
            off = await agent_rollout(client, f"replay:{traj.key}", ws, tools, None)
    assert on.metrics.committed == 1
    assert on.calls == off.calls
