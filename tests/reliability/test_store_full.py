"""The snapshot store filled to ENOSPC (issue #20, item 4): a dump that runs out of space fails with
``StoreFull`` (a ``ForkError``), leaves nothing half-made on the store and the parent running, and the next fork
succeeds once space is freed; restores while the store is full still work (a copy maps or reads the images, it
writes nothing there), and a dump of such a copy fails the same clean way. The store is a small tmpfs of its own
(a full real one would take the machine's memory)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin_async import ForkError, StoreFull, Workspace
from bunshin_async._host import _paths
from bunshin_async._host._snapstore import STORE_OPTIONS
from tests.reliability.campaign import holding_workspace

pytestmark = [pytest.mark.root, pytest.mark.slow]

STORE_MIB = 160


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bunshin-full-", dir="/dev/shm"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={STORE_MIB}m,{STORE_OPTIONS}", "fullstore", str(path)], check=True
    )
    monkeypatch.setenv("BUNSHIN_SNAPDIR", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
        path.rmdir()


def _fill(store: Path, leave_mib: int) -> Path:
    """A filler file that leaves about ``leave_mib`` MiB free (at least one page: the store must not be fuller
    than a real one can be)."""
    st = os.statvfs(store)
    free = st.f_bavail * st.f_frsize
    filler = store / "filler"
    with open(filler, "ab") as f:
        f.write(b"\0" * max(0, free - (leave_mib << 20)))
    return filler


def _run_dir() -> Path:
    return _paths.workspaces_dir()


def _entries(store: Path) -> set[str]:
    return {p.name for p in store.iterdir()}


async def test_dump_into_a_full_store(store: Path) -> None:
    async with Workspace() as ws:
        await holding_workspace(ws)  # 50 MiB of distinct pages: the images need more than is left
        filler = _fill(store, 16)
        with pytest.raises(StoreFull) as info:
            await ws.fork()
        assert isinstance(info.value, ForkError) and info.value.store == str(store)
        assert _entries(store) == {"filler"}, "a failed dump leaves nothing on the store"
        assert (await ws.exec("test -e /tmp/ready && echo alive")).stdout == "alive\n"
        with pytest.raises(StoreFull):  # a full store stays a clean error, also for a snapshot
            await ws.snapshot()
        filler.unlink()
        (copy,) = await ws.fork()
        try:
            assert (await copy.exec("test -e /tmp/ready && echo alive")).stdout == "alive\n"
        finally:
            await copy.aclose()
    assert _entries(store) == set()


async def test_restore_while_the_store_is_full(store: Path) -> None:
    async with Workspace() as ws:
        await holding_workspace(ws)
        async with await ws.snapshot() as snap:
            before = _entries(store)
            filler = _fill(store, 0)  # not a page left: not even a copy's reference file fits
            with pytest.raises(StoreFull):
                await Workspace.from_snapshot(snap, 2)
            assert _entries(store) == before | {"filler"}
            assert {p.name for p in _run_dir().iterdir()} - {".layers"} == {ws.id}, "no half-made copy"
            filler.unlink()
            filler = _fill(store, 1)  # a restore writes nothing but its reference files to the store
            copies = await Workspace.from_snapshot(snap, 2)
            try:
                for copy in copies:
                    # The copies run and write their memory (private pages, not the store's).
                    r = await copy.exec("python3 -c 'b = bytearray(8 << 20); print(len(b))'")
                    assert r.stdout == f"{8 << 20}\n"
                with pytest.raises(StoreFull):  # the copy's own dump has no room
                    await copies[0].fork()
                assert (await copies[0].exec("echo ok")).stdout == "ok\n"
                filler.unlink()
                (grandchild,) = await copies[0].fork()
                await grandchild.aclose()
            finally:
                for copy in copies:
                    await copy.aclose()
    assert _entries(store) == set()
