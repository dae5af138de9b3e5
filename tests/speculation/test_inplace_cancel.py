"""A speculative read runs in the rollout's own workspace (no fork); when the model asks for a write instead, the
turn cancels the read and waits for it (``BranchSet.quiesce``) before the write runs. The write must not see the
read's processes: the cancelled call returns once the agent has reaped them (the client's hang-up), not while they
are still exiting (``test_differential`` once read a final state with such a read in it)."""

from __future__ import annotations

from typing import Any

from bunshin_async import Workspace
from speculator import Rule

from .agent_loop import agent_rollout, held_client, signalling_tools
from .conftest import bash, final, trajectory
from .test_turn import TOOLS, rules

# A read (the tools classify it so): a line of 300 MB that sort holds whole, slow to free when killed.
READ = "head -c 300000000 /dev/zero | sort | wc -c"
WRITE = "ps -eo args= > procs; echo b > g; cat procs"


async def test_a_cancelled_in_place_read_is_gone_before_the_next_write_runs(serve: Any) -> None:
    steps = [bash("echo a > f", llm=0.05), bash(WRITE, llm=0.5), final()]
    rule = Rule(after="echo a", then_tool="bash", then_args={"command": READ}, probability=0.9, expected_seconds=5)
    tools, started = signalling_tools(TOOLS, READ)
    async with serve([trajectory("inplace", steps)]) as client:
        held = held_client(client, 2, started)  # the write's turn is answered once the read runs
        try:
            async with Workspace() as ws:
                spec = rules(rule)
                on = await agent_rollout(held, "replay:inplace", ws, tools, spec)
        finally:
            await held.close()
    [branch] = [b for t in on.turns for b in t.branches]
    assert branch.effect == "read" and branch.outcome == "wasted" and branch.fork_seconds == 0  # in place
    listed = on.calls[1].outcome
    assert listed.startswith("exit code 0\n") and "ps -eo args=" in listed
    assert "sort" not in listed and "head -c" not in listed, listed
