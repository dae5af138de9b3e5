"""Cancellation storms (issue #20, item 4): a group of 16 fork, snapshot and rollback calls on one workspace,
cancelled at a random point, ``BUNSHIN_STORM_ROUNDS`` times (default 200); afterwards nothing is left (the autouse
leak check, and this process's host counts as before) and the workspace still forks."""

from __future__ import annotations

import os
import random

import anyio
import pytest

from bunshin_async import ForkError, Snapshot, Workspace
from tests.reliability.campaign import holding_workspace, settled_state

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROUNDS = int(os.environ.get("BUNSHIN_STORM_ROUNDS", "200"))


async def test_cancellation_storms_leave_nothing() -> None:
    rng = random.Random(2020)
    async with Workspace() as ws:
        await holding_workspace(ws, 8)
        async with await ws.snapshot() as base_snap:
            for warm in [*await ws.fork(1), *await Workspace.from_snapshot(base_snap, 1)]:  # the layer is made once
                await warm.aclose()
            before = await settled_state()
            in_flight = 0
            for _ in range(ROUNDS):
                in_flight += await _storm(ws, base_snap, rng)
            after = await settled_state()
            assert not after.leaks(before, fds=2, rss_mib=32.0), (before, after)
            assert in_flight > ROUNDS, "the storms must cancel calls in flight, not only finished ones"
            try:
                (copy,) = await ws.fork(1)
            except ForkError as exc:
                raise AssertionError(f"the workspace no longer forks after the storms: {exc}") from exc
            await copy.aclose()


async def _storm(ws: Workspace, base_snap: Snapshot, rng: random.Random) -> int:
    """One group of 16 calls cancelled after a random delay; returns how many had not finished."""
    made: list[Workspace] = []
    snaps: list[Snapshot] = []

    async def fork() -> None:
        made.extend(await ws.fork(rng.choice((1, 2))))

    async def snap() -> None:
        snaps.append(await ws.snapshot())

    async def from_snap() -> None:
        made.extend(await Workspace.from_snapshot(base_snap, 1))

    finished = 0
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            for call in [rng.choice((fork, fork, snap, from_snap)) for _ in range(16)]:
                tg.start_soon(call)
            await anyio.sleep(rng.uniform(0, 0.4))
            finished = len(made) + len(snaps)
            scope.cancel()
    for w in made:
        await w.aclose()
    for s in snaps:
        await s.aclose()
    assert (await ws.exec("test -e /tmp/ready && echo alive")).stdout == "alive\n", "the parent survives"
    return 16 - finished
