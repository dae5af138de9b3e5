"""Speculative reads of sibling rollouts through the tool cache's flight of speculative reads (``CachedSession.share``):
when the rollouts of a group speculate the same read at the same state at once, one runs it and serves the others.
Their pids stay those of the cached plain loop: each served rollout holds the runner's pid span as its own read's
(``PidLedger.adopt``), so the rollout that takes the result first keeps the pids (as the plain loop's first asker,
which runs it) and the others put them back (as the plain loop's served askers), whichever rollout guessed first."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

from bunshin_async import Workspace
from bunshin_async._llm._events import ArgumentsComplete, MessageFinished, TapEvent, ToolCall, ToolNameKnown
from bunshin_async.cache import CachedSession, ToolCache
from bunshin_async.speculation import BoundedPolicy, Launch, Speculation, WorkspaceHandle, run_turn
from bunshin_async.tools import Effect, Tool
from speculator import Rule, RulePredictor

ROLLOUTS = 3
BACKGROUND = "sleep 100 >/dev/null 2>&1 & echo $!"
PROBE = "echo $$; sh -c 'echo $$'; true"  # prints the pids of two of its processes


class _Probe:
    """A read that starts processes and prints their pids; every run is counted, and held until ``release``."""

    def __init__(self) -> None:
        self.runs: list[Workspace] = []
        self.release = anyio.Event()

    def tool(self) -> Tool:
        async def run(ws: Workspace, args: dict[str, Any]) -> str:
            self.runs.append(ws)
            await self.release.wait()
            return (await ws.exec(PROBE)).stdout

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


def _speculation(session: CachedSession) -> Speculation:
    """The probe guessed at the turn's start; a call the cache would serve is not run here (``run_agent``'s skip)."""
    rule = Rule(at_start=True, then_tool="probe", then_args={}, probability=0.9, expected_seconds=1.0)

    def skip(launch: Launch) -> bool:
        return session.would_hit(launch.key.name, launch.key.arguments())

    return Speculation(predictors=[RulePredictor([rule])], policy=BoundedPolicy(), group="g", early=True, skip=skip)


async def _started(n: int, ahead: int | None) -> list[Workspace]:
    """``n`` fresh workspaces (their pid cursors alike), but ``ahead``'s, whose cursor is one pid further on."""
    workspaces = [Workspace() for _ in range(n)]
    for ws in workspaces:
        await ws.start()
    if ahead is not None:
        await workspaces[ahead].exec("/bin/true")
    return workspaces


async def _until(done: Any) -> None:
    while not done():
        await anyio.sleep(0.01)


def _waiting(cache: ToolCache) -> int:
    return sum(f.done.statistics().tasks_waiting for f in cache._shared.reads._flights.values())


async def _speculated(asks: list[int], ahead: int | None = None) -> tuple[list[Any], list[int], int, Any]:
    """Three sibling rollouts speculate the probe; rollout 0 guesses it first (it leads), 1 and 2 join its flight;
    the model asks in the order ``asks``, each once the one before took its result. Returns each rollout's result,
    each one's next background pid, how often the probe ran, and the cache's metrics."""
    probe = _Probe()
    gos = [anyio.Event() for _ in range(ROLLOUTS)]
    turns: list[Any] = [None] * ROLLOUTS

    async def rollout(i: int, session: CachedSession) -> None:
        handle = WorkspaceHandle.over(session, salt="g")
        turns[i] = await run_turn(_message(gos[i]), handle, session.tools, _speculation(session))

    async with ToolCache() as cache:
        workspaces = await _started(ROLLOUTS, ahead)
        try:
            sessions = [cache.session(ws, [probe.tool()], salt="g") for ws in workspaces]
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(rollout, 0, sessions[0])
                    await _until(lambda: probe.runs)  # rollout 0 leads (an order, not a time)
                    for i in (1, 2):
                        tg.start_soon(rollout, i, sessions[i])
                    await _until(lambda: _waiting(cache) == ROLLOUTS - 1)
                    assert len(probe.runs) == 1
                    probe.release.set()
                    await _until(lambda: not len(cache._shared.reads))
                    for i in asks:
                        gos[i].set()
                        await _until(lambda i=i: turns[i] is not None)
            results = [[(r.source, r.result) for r in turn.results] for turn in turns]
            pids = [await _next_pid(ws) for ws in workspaces]
            for s in sessions:
                await s.aclose()
            return results, pids, len(probe.runs), cache.metrics()
        finally:
            for ws in workspaces:
                await ws.aclose()


async def _plain(asks: list[int], ahead: int | None = None) -> tuple[list[Any], list[int]]:
    """The cached plain loop: no speculation, the rollouts ask in the order ``asks`` (the first runs the probe, the
    cache serves the others)."""
    probe = _Probe()
    probe.release.set()
    async with ToolCache() as cache:
        workspaces = await _started(ROLLOUTS, ahead)
        try:
            sessions = [cache.session(ws, [probe.tool()], salt="g") for ws in workspaces]
            results: list[Any] = [None] * ROLLOUTS
            for i in asks:
                results[i] = [("speculated", await sessions[i].call("probe", {}))]
            pids = [await _next_pid(ws) for ws in workspaces]
            assert len(probe.runs) == 1
            for s in sessions:
                await s.aclose()
            return results, pids
        finally:
            for ws in workspaces:
                await ws.aclose()


async def test_siblings_speculating_one_read_at_once_run_it_once() -> None:
    results, pids, runs, m = await _speculated([0, 1, 2])
    assert runs == 1
    assert m.reads_shared == ROLLOUTS - 1 and m.reads_shared_seconds > 0
    assert results == [results[0]] * ROLLOUTS and results[0][0][0] == "speculated"
    plain_results, plain_pids = await _plain([0, 1, 2])
    assert (results, pids) == (plain_results, plain_pids)


async def test_the_rollout_that_takes_a_shared_read_first_keeps_its_pids() -> None:
    # Rollout 0 guesses the read first and runs it; rollout 1 asks for it first. The cached plain loop runs it in
    # rollout 1 (its pids move on) and serves rollouts 0 and 2 (theirs stay): a later `cmd & echo $!` prints one
    # pid in rollout 1 and another in 0 and 2. Run in the guesser and kept there (fid21-sf), rollout 0 printed
    # rollout 1's pid and rollout 1 rollout 0's.
    asks = [1, 0, 2]
    results, pids, runs, m = await _speculated(asks)
    plain_results, plain_pids = await _plain(asks)
    assert runs == 1 and m.reads_shared == ROLLOUTS - 1
    assert plain_pids[0] == plain_pids[2] != plain_pids[1]  # (the probe's processes took pids in rollout 1 only)
    assert results == plain_results
    assert pids == plain_pids


async def test_a_sibling_whose_pids_differ_runs_the_read_itself() -> None:
    # Rollout 1 started one process more before: the leader's run printed pids that rollout 1's own run would not
    # print, so rollout 1 is not served by it (its cursor does not stand where the leader's did) and runs the read
    # itself; it asks first, and prints what the cached plain loop's rollout 1 prints, its own pids.
    asks = [1, 0, 2]
    results, pids, runs, m = await _speculated(asks, ahead=1)
    plain_results, plain_pids = await _plain(asks, ahead=1)
    assert runs == 2 and m.reads_shared == 1
    assert results[1] == plain_results[1] != results[0]
    assert pids == plain_pids
