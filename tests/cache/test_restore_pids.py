"""Issue #38 through the tool cache: a rollout a write hit restores from a sibling's snapshot goes on with its own
pids. The snapshot's pid cursor is where the sibling's history left it, reads included that the cache served to
this rollout (which took no pid here): the experiment's download-youtube #0 printed, from step 7 on, two pids more
with fork+cache (restored from #1, which ran `ls -la` and `which ...`) than the oracle (its own fork of the write).
The restore now moves the rollout's own cursor as far as the write moved the sibling's (``Entry.pids``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from bunshin_async import Workspace
from bunshin_async._llm._events import ArgumentsComplete, MessageFinished, TapEvent, ToolCall, ToolNameKnown
from bunshin_async._workspace._facade import mark_pids
from bunshin_async.cache import ForkStateProvider, ToolCache
from bunshin_async.speculation import BoundedPolicy, Speculation, WorkspaceHandle, run_turn
from bunshin_async.tools import Effect, Tool, builtin_tools
from speculator import Rule, RulePredictor

from .test_session import sources

pytestmark = pytest.mark.usefixtures("need_workspaces")

READ = {"command": "ls -la /; /bin/true"}  # served to the second rollout: no process there
WRITE = {"command": "echo a > f; /bin/true; /bin/true"}  # restored: its processes' pids count as the rollout's
NEXT = {"command": "echo $$"}  # the pid the rollout's next process gets


async def _bash(ws: Workspace, args: dict[str, Any]) -> Any:
    tool = next(t for t in builtin_tools() if t.name == "bash")
    assert tool.handler is not None
    return await tool.handler(ws, tool.normalize(args))


def _pid(result: Any) -> int:
    return int(result.stdout.split()[-1])


async def _plain(*calls: dict[str, Any]) -> int:
    """The pid a fresh workspace's next process gets after ``calls`` ran there (the cached plain loop's rollout
    that was served the read: it ran the write only)."""
    async with Workspace() as ws:
        for args in calls:
            await _bash(ws, args)
        return _pid(await _bash(ws, NEXT))


@pytest.mark.parametrize("runner", ["main line", "committed fork"])
async def test_a_write_hit_continues_the_rollouts_own_pids(runner: str) -> None:
    # The sibling runs the read and the write (the write on its main line, or in a fork of a speculative branch
    # that it commits); the rollout after it is served both. Without the restore's move it printed the sibling's
    # next pid, the read's pids more than its own.
    async with ToolCache(provider=ForkStateProvider()) as cache:
        async with Workspace() as ws, cache.session(ws) as sibling:
            await sibling.call("bash", READ)
            if runner == "main line":
                await sibling.call("bash", WRITE)
            else:
                (fork,) = await sibling.workspace.fork()
                await mark_pids(fork)  # what the speculation runtime's write branch does before its call
                result = await _bash(fork, WRITE)
                await sibling.adopt(fork, "bash", WRITE, result, 0.1)
            sibling_next = _pid(await _bash(sibling.workspace, NEXT))
        async with Workspace() as ws, cache.session(ws) as session:
            await session.call("bash", READ)
            await session.call("bash", WRITE)
            assert sources(session) == ["cache", "restored"]
            served_next = _pid(await _bash(session.workspace, NEXT))
    assert served_next == await _plain(WRITE)
    assert sibling_next == await _plain(READ, WRITE) > served_next  # the read took pids: the test can fail


class _Tools:
    """A read and a write that start processes (``READ``, ``WRITE``); the workspaces the write ran in, in order."""

    def __init__(self) -> None:
        self.writes: list[Workspace] = []

    def tools(self) -> list[Tool]:
        async def read(ws: Workspace, args: dict[str, Any]) -> str:
            return (await ws.exec(READ["command"])).stdout

        async def write(ws: Workspace, args: dict[str, Any]) -> str:
            self.writes.append(ws)
            return (await ws.exec(WRITE["command"])).stdout

        return [Tool(name="r", effect=Effect.READ, handler=read, result_type=str),
                Tool(name="w", effect=Effect.WRITE, handler=write, result_type=str)]  # fmt: skip


async def _asks_for_the_write(go: anyio.Event) -> AsyncIterator[TapEvent]:
    await go.wait()
    call = ToolCall(index=0, id="c0", name="w", arguments={}, raw="{}")
    yield ToolNameKnown(index=0, id=call.id, name=call.name, t=0.0)
    yield ArgumentsComplete(call=call, t=0.0)
    yield MessageFinished(finish_reason="tool_calls", content="", tool_calls=[call], t=0.0)


async def test_a_write_a_speculative_fork_ran_restores_with_the_rollouts_own_pids() -> None:
    # Through the speculation runtime: the sibling's write is guessed at its turn's start and runs in a fork, which
    # the rollout commits when the model asks for it (the branch marks the fork's pids before its call). The
    # rollout after it is served the read and restored from that fork's capture.
    made = _Tools()
    rule = Rule(at_start=True, then_tool="w", then_args={}, probability=1.0, expected_seconds=1.0)
    async with ToolCache(provider=ForkStateProvider()) as cache:
        async with Workspace() as ws, cache.session(ws, made.tools(), salt="g") as sibling:
            await sibling.call("r", {})
            spec = Speculation(predictors=[RulePredictor([rule])], policy=BoundedPolicy(), group="g", early=True)
            go = anyio.Event()
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:

                    async def turn() -> None:
                        handle = WorkspaceHandle.over(sibling, salt="g")
                        outcome = await run_turn(_asks_for_the_write(go), handle, sibling.tools, spec)
                        assert [r.source for r in outcome.results] == ["speculated"]

                    tg.start_soon(turn)
                    while not made.writes:  # the branch's call runs in its fork (an order, not a time)
                        await anyio.sleep(0.01)
                    go.set()
            assert made.writes[0] is sibling.workspace  # the fork, committed
            sibling_next = _pid(await _bash(sibling.workspace, NEXT))
        async with Workspace() as ws, cache.session(ws, made.tools(), salt="g") as session:
            await session.call("r", {})
            await session.call("w", {})
            assert sources(session) == ["cache", "restored"]
            served_next = _pid(await _bash(session.workspace, NEXT))
    assert served_next == await _plain(WRITE)
    assert sibling_next == await _plain(READ, WRITE) > served_next
