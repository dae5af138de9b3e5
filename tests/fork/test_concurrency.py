"""Concurrent snapshot, fork, rollback and cache-capture requests on one workspace (issue #20, item 2): CRIU seizes
the whole tree, so two dumps of one workspace at once collided in ``PTRACE_SEIZE``. Forks are coalesced (16
concurrent ``fork(1)`` share one or two dumps), the rest are serialized; nothing fails. Both restore modes."""

from __future__ import annotations

import random

import anyio
import anyio.lowlevel
import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork import _dump
from bunshin_async.cache import ForkStateProvider

pytestmark = pytest.mark.fork_modes("criu-cow", "criu")


@pytest.fixture
def dumps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Workspace ids of the CRIU dumps made, in order (a wrapper around the real dump)."""
    made: list[str] = []
    real = _dump._dump

    async def counting(ws: Workspace, *args: object, **kwargs: object) -> None:
        made.append(ws.id)
        await real(ws, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_dump, "_dump", counting)
    return made


async def test_sixteen_concurrent_forks_share_a_dump(ws: Workspace, dumps: list[str]) -> None:
    await ws.exec('echo parent > /workspace/state; python3 -c \'open("/dev/shm/m", "wb").write(b"x" * (4 << 20))\'')
    results: list[list[Workspace]] = []

    async def one() -> None:
        results.append(await ws.fork(1))

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(16):
                tg.start_soon(one)
        copies = [c for r in results for c in r]
        assert len(copies) == 16 and len({c.id for c in copies}) == 16
        assert len(dumps) <= 2, f"16 concurrent forks took {len(dumps)} dumps"
        for i, copy in enumerate(copies):
            assert (await copy.exec("cat /workspace/state")).stdout == "parent\n"
            await copy.write_file("/workspace/state", f"copy {i}\n")
        for i, copy in enumerate(copies):
            assert (await copy.exec("cat /workspace/state")).stdout == f"copy {i}\n"
        assert (await ws.exec("cat /workspace/state")).stdout == "parent\n"
    finally:
        for r in results:
            for copy in r:
                await copy.aclose()


async def test_snapshots_forks_rollbacks_and_captures_race(ws: Workspace, dumps: list[str]) -> None:
    await ws.exec("echo 0 > /workspace/gen")
    base = await ws.snapshot()
    provider = ForkStateProvider()
    rng = random.Random(20)
    snaps: list[Snapshot] = []
    copies: list[Workspace] = []
    refs = []

    async def snap() -> None:
        snaps.append(await ws.snapshot())

    async def fork() -> None:
        copies.extend(await ws.fork(rng.choice([1, 2])))

    async def rollback() -> None:
        await ws.rollback(base)

    async def capture() -> None:
        refs.append(await provider.capture(ws))

    calls = [snap] * 4 + [fork] * 4 + [rollback] * 3 + [capture] * 3
    rng.shuffle(calls)
    try:
        async with anyio.create_task_group() as tg:
            for call in calls:
                tg.start_soon(call)
        assert len(snaps) == 4 and len(refs) == 3 and len(copies) >= 4
        for copy in copies:
            assert (await copy.exec("cat /workspace/gen")).exit_code == 0
        for ref in refs:
            restored = await provider.restore(ws, ref)
            copies.append(restored)
            assert (await restored.exec("cat /workspace/gen")).exit_code == 0
        await ws.rollback(base)
        assert (await ws.exec("cat /workspace/gen")).stdout == "0\n"
    finally:
        for copy in copies:
            await copy.aclose()
        for s in snaps:
            await s.aclose()
        for ref in refs:
            await provider.discard(ref)
        await base.aclose()


async def test_cancelled_fork_leaves_its_batch_intact(ws: Workspace) -> None:
    """A fork cancelled while it waits for (or takes) the shared dump does not fail the forks batched with it."""
    got: list[Workspace] = []

    async def one() -> None:
        got.extend(await ws.fork(1))

    try:
        async with anyio.create_task_group() as tg:
            victim = anyio.CancelScope()  # entered by the victim's task
            tg.start_soon(_in_scope, victim, ws)
            for _ in range(3):
                tg.start_soon(one)
            await anyio.lowlevel.checkpoint()
            victim.cancel()
        assert len(got) == 3
    finally:
        for copy in got:
            await copy.aclose()


async def _in_scope(scope: anyio.CancelScope, ws: Workspace) -> None:
    with scope:
        copies = await ws.fork(1)
        for copy in copies:  # finished before the cancel reached it
            await copy.aclose()
