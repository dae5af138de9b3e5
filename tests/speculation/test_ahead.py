"""Launching on the observation, through ``run_agent`` on real workspaces and CRIU forks: once a turn's last call
has its result, the write predicted to open the next turn starts in a fork before the next model request goes out
(the request waits for it: an order, not a time; calls run after their message ends, so the prediction is not
made for a later call of the same message instead). The next turn commits it when the model asks for it (same calls,
results and final state as the plain loop) and rolls it back when the model asks for something else; a rollout
cancelled while the fork runs leaves nothing behind (the root conftest's leak checks)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest

from bunshin_async import Workspace
from bunshin_async.speculation import Speculation
from bunshin_async.tools import Tool, bash_tool, read_file_tool
from speculator import CostAwarePolicy, Rule, RulePredictor

from .agent_loop import agent_rollout
from .conftest import bash, final, trajectory

SLOW = "sleep 1; echo x > f"
START = "echo a > start"


class _Gate:
    """A bash tool that sets ``started`` when ``predicted`` starts (only a branch runs it before the model asks) and,
    cancelled, holds on until ``release`` is set; an openai client whose request number ``turn`` goes out only
    once ``started`` is set, and whose request number ``release_at`` sets ``release``."""

    def __init__(self, client: Any, turn: int, *, predicted: str = SLOW, release_at: int | None = None) -> None:
        self.client, self.turn, self.release_at, self.requests = client, turn, release_at, 0
        self.started, self.release = anyio.Event(), anyio.Event()
        self.order: list[str] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))
        inner = bash_tool()
        handler = inner.handler
        assert handler is not None

        async def run(ws: Any, args: dict[str, Any]) -> Any:
            if args.get("command") != predicted:
                return await handler(ws, args)
            self.started.set()
            try:
                return await handler(ws, args)
            except anyio.get_cancelled_exc_class():
                if release_at is not None:
                    with anyio.CancelScope(shield=True), anyio.fail_after(60):
                        await self.release.wait()
                    self.order.append("branch let go")
                raise

        self.tools: list[Tool] = [msgspec.structs.replace(inner, handler=run), read_file_tool()]

    async def _create(self, **options: Any) -> Any:
        n, self.requests = self.requests, self.requests + 1
        if n == self.turn:
            with anyio.fail_after(60):  # without the launch on the observation it would never be set
                await self.started.wait()
        if n == self.release_at:
            self.order.append(f"request {n}")
            self.release.set()
        return await self.client.chat.completions.create(**options)


def _speculation(predicted: str = SLOW) -> Speculation:
    rule = Rule(after="start", then_tool="bash", then_args={"command": predicted}, probability=0.9,
                expected_seconds=1.0)  # fmt: skip
    policy = CostAwarePolicy(contention=None, loop_load=None, memory_weight=0.0)  # the mechanism, not the GiB·s rule
    return Speculation(predictors=[RulePredictor([rule])], policy=policy)


@pytest.mark.parametrize("asks_for_it", [True, False])
async def test_the_next_turns_write_starts_in_a_fork_before_the_next_request(serve: Any, asks_for_it: bool) -> None:
    then = SLOW if asks_for_it else "echo right > r"
    steps = [bash(START, llm=0.05), bash(then, llm=0.3), bash("ls; ps -eo args= | grep -c '[s]leep 1' || true"),
             final()]  # fmt: skip
    async with serve([trajectory("ahead", steps)]) as client:
        async with Workspace() as ws0:
            off = await agent_rollout(client, "replay:ahead", ws0, [bash_tool(), read_file_tool()], None)
        gate = _Gate(client, turn=1)
        async with Workspace() as ws1:
            on = await agent_rollout(gate, "replay:ahead", ws1, gate.tools, _speculation(), early=False)
    assert on.calls == off.calls and on.final_state == off.final_state
    [branch] = [b for t in on.turns for b in t.branches]
    assert branch.ahead and branch.effect == "write" and branch.launched_at < 0  # before turn 1 started
    assert on.turns[1].launched_ahead == 1 and on.turns[1].ahead_seconds > 0
    if asks_for_it:
        assert branch.outcome == "committed" and on.moved and branch.saved_seconds > 0
        assert on.calls[2].outcome.startswith("exit code 0\nf\n")
    else:
        assert branch.outcome == "wasted" and not on.moved
        assert on.calls[2].outcome == "exit code 0\nr\nstart\n0\n"  # rolled back: no f, no sleep left


async def test_a_rollout_cancelled_while_the_fork_runs_leaves_nothing(serve: Any) -> None:
    steps = [bash(START, llm=0.05), bash(SLOW, llm=0.3), final()]
    spec = _speculation()
    async with serve([trajectory("gone", steps)]) as client:
        gate = _Gate(client, turn=1)

        async def cancel_when_it_runs(scope: anyio.CancelScope) -> None:
            await gate.started.wait()
            scope.cancel()  # the next request is held: the rollout is cancelled while the branch's fork runs

        async with Workspace() as ws:
            with anyio.fail_after(60), anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_when_it_runs, scope)
                    await agent_rollout(gate, "replay:gone", ws, gate.tools, spec, early=False)
            assert scope.cancelled_caught
            assert (await ws.exec("ls /workspace")).stdout == "start\n"  # the fork's write is not the rollout's
            assert "sleep" not in (await ws.exec(["ps", "-eo", "args="])).stdout
    [branch] = [b for t in spec.turns for b in t.branches]
    assert branch.ahead and branch.outcome == "wasted" and spec.metrics.wasted == 1
    # the leak fixtures check that no fork, snapshot, mount, cgroup or process is left


async def test_the_next_request_does_not_wait_for_a_wrong_branchs_fork_to_go(serve: Any) -> None:
    """A wrong write's branch, cancelled by the model's other call, holds on (its tool, cancelled, waits) until the
    request after that turn went out: the turn hands its unused branches over without waiting for their forks to
    stop and close (they settle in the rollout's task group, which the rollout's end waits for)."""
    wrong = "sleep 5; echo w > w"
    steps = [bash(START, llm=0.05), bash("echo right > r", llm=0.3), final()]
    spec = _speculation(wrong)
    async with serve([trajectory("slowgo", steps)]) as client:
        gate = _Gate(client, turn=1, predicted=wrong, release_at=2)
        async with Workspace() as ws:
            run = await agent_rollout(gate, "replay:slowgo", ws, gate.tools, spec, early=False)
    assert gate.order == ["request 2", "branch let go"]
    assert " ./w -> " not in run.final_state and " ./r -> " in run.final_state and not run.moved
    [branch] = [b for t in spec.turns for b in t.branches]
    assert branch.ahead and branch.outcome == "wasted" and spec.metrics.wasted == 1
