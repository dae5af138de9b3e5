"""The capture rule in byte-seconds on real workspaces and live snapshots (``ToolCache(weigh_captures=True)``): a
slow write is captured for the siblings that may follow only when what they are spared pays for holding the
capture until the last of them gets there. The time between two writes of a session (the model's time, here
scripted on the state tree's clock) sets the expected hold; the write itself runs for real."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest

from bunshin_async import Workspace
from bunshin_async.cache import CachedSession, ForkStateProvider, ToolCache
from tests._walks import Walks

pytestmark = pytest.mark.usefixtures("need_workspaces")

WRITE = {"command": "sleep 0.5; echo built > out"}


class Clock:
    """The state tree's clock: seconds of model time the test scripts between calls."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@asynccontextmanager
async def group(
    n: int, *, weigh: bool = True, setup: str | None = None
) -> AsyncIterator[tuple[ToolCache, ForkStateProvider, Clock, list[CachedSession]]]:
    """``n`` tiny workspaces whose sessions open together on one cache (a group's rollouts), each having run
    ``setup`` first."""
    provider, clock = ForkStateProvider(), Clock()
    async with AsyncExitStack() as stack:
        cache = await stack.enter_async_context(
            ToolCache(provider=provider, capture_min_duration=0.3, release_unreachable=True, weigh_captures=weigh)
        )
        cache.tree.clock = clock
        wss = [await stack.enter_async_context(Workspace()) for _ in range(n)]
        for ws in wss:
            if setup is not None:
                assert (await ws.exec(setup)).exit_code == 0
        sessions = [await stack.enter_async_context(cache.session(ws)) for ws in wss]
        yield cache, provider, clock, sessions


@pytest.mark.parametrize("think", [1.0, 40.0])
async def test_a_capture_is_taken_when_the_siblings_pay_for_its_hold_and_skipped_when_they_cannot(
    think: float,
) -> None:
    """Two siblings stand where the first rollout was before its 0.5 s write. After 1 s of model time they are
    expected there within a quarter of that: 2 x 0.5 s saved pays for a capture as big as a rollout held 0.25 s;
    after 40 s (a long LLM turn) the hold is expected to last 10 s more, which 1 s saved cannot pay: not captured,
    and each sibling runs the write itself."""
    async with group(3) as (cache, provider, clock, (first, *siblings)):
        clock.t = think
        await first.call("bash", WRITE)
        m = cache.metrics()
        if think == 1.0:
            assert (m.captures, m.captures_skipped_cost, len(provider)) == (1, 0, 1)
        else:
            assert (m.captures, m.captures_skipped_cost, len(provider)) == (0, 1, 0)
        for s in siblings:
            clock.t += 0.1
            await s.call("bash", WRITE)
        expected = "restored" if think == 1.0 else "executed"
        assert [s.history[-1].source for s in siblings] == [expected, expected]
        assert [(await s.call("bash", {"command": "cat out"})).stdout for s in siblings] == ["built\n"] * 2
        m = cache.metrics()
        assert m.restores == (2 if think == 1.0 else 0) and len(provider) == 0  # released once both had it


async def test_without_the_rule_a_long_hold_is_captured_as_before() -> None:
    async with group(3, weigh=False) as (cache, provider, clock, (first, *_)):
        clock.t = 40.0
        await first.call("bash", WRITE)
        m = cache.metrics()
        assert (m.captures, m.captures_skipped_cost, len(provider)) == (1, 0, 1)


@pytest.mark.parametrize("think", [1.0, 40.0])
async def test_the_rule_weighs_a_workspace_of_many_files_without_walking_it(
    think: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule runs on every slow write a sibling may follow: its reading of the rollout's bytes walks none of the
    workspace's 20000 files (a walk takes seconds at 100k) and decides as on a small one."""
    many = "mkdir many && cd many && seq 20000 | xargs touch && seq 200 | xargs -I{} sh -c 'echo {} > {}'"
    async with group(3, setup=many) as (cache, provider, clock, (first, *_)):
        walks = Walks().install(monkeypatch)
        clock.t = think
        await first.call("bash", WRITE)
        m = cache.metrics()
        assert (m.captures, m.captures_skipped_cost) == ((1, 0) if think == 1.0 else (0, 1))
        assert walks.under(first.workspace.directory) == []
