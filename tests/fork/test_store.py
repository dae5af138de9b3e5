"""The snapshot store (``_fork.prepare_snapshot_store``, ``bunshin snapstore``): a tmpfs with large folios, which the
test session mounts on its private snapshot directory exactly as the set-up does on the default one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import pytest

from bunshin_async import CapabilityMissing, Workspace
from bunshin_async._cli._main import main as cli
from bunshin_async._host._snapstore import prepare_snapshot_store, snapshot_store

pytestmark = pytest.mark.fork_modes("criu-cow")

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _mounts(path: Path) -> int:
    return sum(1 for line in Path("/proc/self/mountinfo").read_text().splitlines() if line.split()[4] == str(path))


def _large_shmem_folios() -> int:
    """Large shmem folios the kernel has allocated so far, all sizes (mTHP per-size stats)."""
    return sum(int((d / "stats" / "shmem_alloc").read_text()) for d in THP.glob("hugepages-*kB"))


def test_the_session_store_has_large_folios() -> None:
    huge, where = snapshot_store()
    assert huge and where.endswith("on tmpfs (huge=within_size)"), where


def test_prepare_mounts_once_and_never_over_snapshots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    monkeypatch.setenv("BUNSHIN_SNAPDIR", str(store))
    assert not snapshot_store()[0]  # tmp_path is not on a huge tmpfs
    try:
        assert cli(["snapstore"]) == 0
        assert capsys.readouterr().out == f"snapshot store: {store} on tmpfs (huge=within_size)\n"
        assert prepare_snapshot_store() == f"{store} on tmpfs (huge=within_size)"  # idempotent
        assert _mounts(store) == 1 and snapshot_store()[0]
    finally:
        subprocess.run(["umount", str(store)], check=True)
    (store / "some-snapshot").mkdir()
    with pytest.raises(CapabilityMissing, match="holds snapshots"):
        prepare_snapshot_store()
    assert cli(["snapstore"]) == 1 and "holds snapshots" in capsys.readouterr().err
    assert _mounts(store) == 0


async def test_page_images_are_written_in_large_folios() -> None:
    async with Workspace() as ws:
        heap = "b = bytearray(range(256)) * (64 << 12); open('/workspace/ready', 'w').close(); time.sleep(600)"
        await ws.spawn(["python3", "-c", f"import time; {heap}"])
        with anyio.fail_after(30):
            while (await ws.exec("test -e /workspace/ready")).exit_code:  # noqa: ASYNC110 - polls the guest
                await anyio.sleep(0.02)
        before = _large_shmem_folios()
        snap = await ws.snapshot()
        try:
            assert _large_shmem_folios() - before >= 16  # 64 MiB of pages: 64 folios of 1 MiB, or fewer larger ones
        finally:
            await snap.aclose()
