"""A write branch the model asks for while its call still runs: the rollout moves into the fork at the ask (its old
workspace closed then, not when the call ends), on real workspaces and forks, with the replay server's streams."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec

from bunshin_async import Workspace
from bunshin_async._exceptions import WorkspaceError
from bunshin_async._llm._openai import tap_openai_stream
from bunshin_async.speculation import Speculation, SpeculativeTurn, TurnOutcome, WorkspaceHandle, run_turn
from bunshin_async.tools import Tool, bash_tool
from speculator import CostAwarePolicy, Rule, RulePredictor

from .conftest import bash, final, trajectory

GATED = "while [ ! -e go ]; do sleep 0.02; done; echo x > f"  # runs until the test lets it end
STEPS = [bash("echo a > start", llm=0.05), bash(GATED, llm=0.3), final()]


def _spec() -> Speculation:
    rule = Rule(after="start", then_tool="bash", then_args={"command": GATED}, probability=0.9, expected_seconds=30)
    return Speculation(
        predictors=[RulePredictor([rule])], policy=CostAwarePolicy(contention=None, loop_load=None, memory_weight=0)
    )


async def _second_turn(client: Any, handle: WorkspaceHandle, tools: list[Tool], spec: Speculation) -> tuple[Any, Any]:
    """Run the first turn (``echo a > start``: the rule then predicts ``GATED``); the second turn's stream and the
    tool specs to tap it with."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "x"}]
    specs = [t.spec() for t in tools]
    stream = await client.chat.completions.create(model="replay:move", messages=msgs, tools=specs, stream=True)
    async with tap_openai_stream(stream, specs) as tap:
        first = await run_turn(tap, handle, tools, spec)
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function",
         "function": {"name": "bash", "arguments": first.message.tool_calls[0].raw}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "ok"},
    ]  # fmt: skip
    stream = await client.chat.completions.create(model="replay:move", messages=msgs, tools=specs, stream=True)
    return stream, specs


async def _moved(turn: SpeculativeTurn) -> None:
    with anyio.fail_after(60):  # a hang guard, not a measurement
        while "branch_move" not in [e.kind for e in turn.metrics.timeline]:  # noqa: ASYNC110 - the turn's log
            await anyio.sleep(0.01)


async def test_a_hit_still_running_moves_the_rollout_into_its_fork_at_the_ask(serve: Any) -> None:
    spec, tools = _spec(), [bash_tool()]
    async with serve([trajectory("move", STEPS)]) as client:
        async with Workspace() as ws, WorkspaceHandle(ws) as handle:
            stream, specs = await _second_turn(client, handle, tools, spec)
            outcome: TurnOutcome | None = None
            async with tap_openai_stream(stream, specs) as tap, SpeculativeTurn(handle, tools, spec) as turn:

                async def consume() -> None:
                    nonlocal outcome
                    outcome = await turn.consume(tap)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume)
                    await _moved(turn)
                    # the call still runs in the fork (it waits for `go`), and the old workspace is closed already
                    kinds = [e.kind for e in turn.metrics.timeline]
                    assert "branch_done" not in kinds and outcome is None, kinds
                    assert ws.closed and handle.workspace is not ws and handle.swaps == 1
                    assert handle.epoch == 1  # the state the call makes is not named before it ends
                    await handle.workspace.exec("touch /workspace/go")
            assert outcome is not None
            [result] = outcome.results
            assert result.source == "speculated" and result.error is None
            assert turn.metrics.committed == 1 and [b.outcome for b in turn.metrics.branches] == ["committed"]
            kinds = [e.kind for e in turn.metrics.timeline]
            assert kinds.index("branch_move") < kinds.index("branch_done") < kinds.index("branch_commit"), kinds
            assert handle.epoch == 2
            assert (await handle.workspace.exec("cat f; ls")).stdout == "x\nf\ngo\nstart\n"


async def test_a_moved_branch_whose_workspace_fails_fails_the_call_and_leaves_nothing(serve: Any) -> None:
    """After the move the fork is the rollout's workspace: a failure of it (not a ``ToolError``) ends the turn with
    that error, as a main-line call in a failing workspace does; the fork is the handle's and closes with it."""
    inner = bash_tool()
    assert inner.handler is not None
    real = inner.handler
    first_ws: list[Workspace] = []

    async def fragile(ws: Workspace, args: dict[str, Any]) -> Any:  # injects the fault: the fork dies in its call
        result = await real(ws, args)
        if first_ws and ws is not first_ws[0] and "go" in str(args.get("command")):
            raise WorkspaceError("injected: the fork's workspace died", workspace_id=ws.id)
        return result

    tools = [msgspec.structs.replace(inner, handler=fragile)]
    spec = _spec()
    async with serve([trajectory("move", STEPS)]) as client:
        async with Workspace() as ws, WorkspaceHandle(ws) as handle:
            first_ws.append(ws)
            stream, specs = await _second_turn(client, handle, tools, spec)
            caught: list[BaseException] = []
            async with tap_openai_stream(stream, specs) as tap:
                try:
                    async with SpeculativeTurn(handle, tools, spec) as turn, anyio.create_task_group() as tg:
                        tg.start_soon(turn.consume, tap)
                        await _moved(turn)
                        assert ws.closed
                        await handle.workspace.exec("touch /workspace/go")
                except WorkspaceError as exc:
                    caught.append(exc)
            assert caught and "injected" in str(caught[0])
            fork = handle.workspace
            assert fork is not ws and not fork.closed  # the handle's: closed with it (the leak checks see the rest)
        assert fork.closed


async def test_a_turn_cancelled_after_the_move_leaves_nothing(serve: Any) -> None:
    spec, tools = _spec(), [bash_tool()]
    async with serve([trajectory("move", STEPS)]) as client:
        async with Workspace() as ws, WorkspaceHandle(ws) as handle:
            stream, specs = await _second_turn(client, handle, tools, spec)
            with anyio.CancelScope() as scope:
                async with tap_openai_stream(stream, specs) as tap, SpeculativeTurn(handle, tools, spec) as turn:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(turn.consume, tap)
                        await _moved(turn)
                        scope.cancel()
            assert scope.cancelled_caught
            fork = handle.workspace
            assert ws.closed and fork is not ws and not fork.closed
            probe = await fork.exec(["ps", "-eo", "args="])
            assert "sleep" not in probe.stdout  # the cancelled call's process group was killed
        assert fork.closed
    # the leak fixtures check that no fork, snapshot or process is left
