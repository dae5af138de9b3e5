"""Warm spares (``snap.keep_spares(k)``): ``from_snapshot`` hands out a frozen, pre-restored copy, thawed; the
copy is live and correct; the pool refills in the background; closing the pool or the snapshot closes the spares not
handed out (the root conftest checks nothing is left)."""

from __future__ import annotations

import anyio
import pytest

from bunshin_async import Workspace
from bunshin_async._fork._snapshot import record_of

pytestmark = pytest.mark.fork_modes("criu-cow")  # the pool is the same for every restore mode


async def test_a_ready_spare_is_handed_out_live_and_refilled(ws: Workspace) -> None:
    await ws.write_file("/workspace/f", "v1")
    await ws.spawn(["python3", "-c", "import time; time.sleep(10**6)"])
    async with await ws.snapshot() as snap, snap.keep_spares(2) as pool:
        with anyio.fail_after(60):
            await pool.wait_ready()
        assert pool.ready == 2 and pool.error is None
        assert all(s.cgroup is not None and s.cgroup.frozen() for s in pool._ready)
        spares = [s.id for s in pool._ready]
        [c] = await Workspace.from_snapshot(snap)
        try:
            # a ready spare was handed out (a thaw, not a restore: bench/fork_bench.py measures what that saves)
            left = [s.id for s in pool._ready]
            assert c.id == spares[0] and c.id not in left and spares[1] in left
            assert c.cgroup is not None and not c.cgroup.frozen() and c.fork_mode == "criu-cow"
            assert await c.read_text("/workspace/f") == "v1"
            await c.write_file("/workspace/f", "copy")
            assert await ws.read_text("/workspace/f") == "v1"
            assert "time.sleep" in (await c.exec("ps -eo args")).stdout
            with anyio.fail_after(60):  # the pool restores a replacement behind the one handed out
                await pool.wait_ready()
            # More than are ready: the spares first, the rest restored now.
            more = await Workspace.from_snapshot(snap, 3)
            try:
                for m in more:
                    assert await m.read_text("/workspace/f") == "v1"
            finally:
                with anyio.CancelScope(shield=True):
                    for m in more:
                        await m.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                await c.aclose()


async def test_closing_the_snapshot_closes_its_spares(ws: Workspace) -> None:
    snap = await ws.snapshot()
    async with snap.keep_spares(1) as pool:
        with anyio.fail_after(60):
            await pool.wait_ready()
        await snap.aclose()
        assert pool.ready == 0 and record_of(snap).spares is None
    await ws.ping()  # the parent is untouched
