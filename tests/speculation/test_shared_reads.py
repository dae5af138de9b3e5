"""Speculative reads of sibling rollouts through the tool cache's single flight (``CachedSession.share``): when
the rollouts of a group speculate the same read at the same state at once, one runs it and serves the others, as
the cache serves their main-line calls; the rollouts served ran no process for it (their pids are the plain loop
with the cache's), and their sessions record a shared hit; one that speculates it later is served from the store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

from bunshin_async import Workspace
from bunshin_async._llm._events import ArgumentsComplete, MessageFinished, TapEvent, ToolCall, ToolNameKnown
from bunshin_async.cache import CachedSession, ToolCache
from bunshin_async.speculation import BoundedPolicy, Speculation, WorkspaceHandle, run_turn
from bunshin_async.tools import Effect, Tool
from speculator import Rule, RulePredictor

ROLLOUTS = 3
BACKGROUND = "sleep 100 >/dev/null 2>&1 & echo $!"


class _Probe:
    """A read that starts processes; every run is counted, and held until ``release``."""

    def __init__(self) -> None:
        self.runs: list[Workspace] = []
        self.release = anyio.Event()

    def tool(self) -> Tool:
        async def run(ws: Workspace, args: dict[str, Any]) -> str:
            self.runs.append(ws)
            await self.release.wait()
            return (await ws.exec("cat /etc/hostname; /bin/true")).stdout

        return Tool(name="probe", effect=Effect.READ, handler=run, result_type=str)


async def _message(go: anyio.Event) -> AsyncIterator[TapEvent]:
    """The model asks for the probe once ``go`` is set (it thinks meanwhile: the branch runs)."""
    await go.wait()
    call = ToolCall(index=0, id="c0", name="probe", arguments={}, raw="{}")
    yield ToolNameKnown(index=0, id=call.id, name=call.name, t=0.0)
    yield ArgumentsComplete(call=call, t=0.0)
    yield MessageFinished(finish_reason="tool_calls", content="", tool_calls=[call], t=0.0)


async def _next_pid(ws: Workspace) -> int:
    return int((await ws.exec(BACKGROUND)).stdout)


async def test_siblings_speculating_one_read_at_once_run_it_once() -> None:
    probe, go = _Probe(), anyio.Event()
    rule = Rule(at_start=True, then_tool="probe", then_args={}, probability=0.9, expected_seconds=1.0)
    outcomes: list[Any] = [None] * (ROLLOUTS + 1)

    async def rollout(i: int, session: CachedSession, go: anyio.Event) -> None:
        spec = Speculation(predictors=[RulePredictor([rule])], policy=BoundedPolicy(), group="g", early=True)
        handle = WorkspaceHandle.over(session, salt="g")
        outcomes[i] = await run_turn(_message(go), handle, session.tools, spec)

    async with ToolCache() as cache, Workspace() as plain, Workspace() as ran:
        workspaces = [Workspace() for _ in range(ROLLOUTS + 1)]  # the last one comes once the others ended
        try:
            for ws in workspaces:
                await ws.start()
            sessions = [cache.session(ws, [probe.tool()], salt="g") for ws in workspaces]
            flights = cache._shared.flights
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i, session in enumerate(sessions[:ROLLOUTS]):
                        tg.start_soon(rollout, i, session, go)
                    # one leads and runs, the others wait for its flight (an order, not a time)
                    while not (probe.runs and len(flights) == 1 and _waiting(flights) == ROLLOUTS - 1):
                        assert len(probe.runs) <= 1  # (each running it: no need to wait for the deadline)
                        await anyio.sleep(0.01)
                    probe.release.set()
                    while len(flights):  # its outcome is stored and handed to the waiters
                        await anyio.sleep(0.01)
                    go.set()
                async with anyio.create_task_group() as tg:  # a sibling that speculates it later: the store serves it
                    late, late_go = sessions[ROLLOUTS], anyio.Event()
                    tg.start_soon(rollout, ROLLOUTS, late, late_go)
                    while not late._calls.speculated:
                        await anyio.sleep(0.01)
                    late_go.set()
            assert len(probe.runs) == 1
            (leader,) = probe.runs
            read = await ran.exec("cat /etc/hostname; /bin/true")  # what the plain loop ran (in one rollout)
            for out in outcomes:
                assert [(r.source, r.result) for r in out.results] == [("speculated", read.stdout)]
            assert sorted(r.source for s in sessions for r in s.history) == ["adopted", "cache", "shared", "shared"]
            m = cache.metrics()
            assert (m.hits, m.misses) == (ROLLOUTS, 1)
            # pids: the leader's read ran there and was used (it stays); the others ran no process for it
            assert await _next_pid(leader) == await _next_pid(ran)
            nothing_ran = await _next_pid(plain)
            assert [await _next_pid(ws) for ws in workspaces if ws is not leader] == [nothing_ran] * ROLLOUTS
            for s in sessions:
                await s.aclose()
        finally:
            for ws in workspaces:
                await ws.aclose()


def _waiting(flights: Any) -> int:
    return sum(f.done.statistics().tasks_waiting for f in flights._flights.values())
