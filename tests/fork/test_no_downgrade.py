"""No silent downgrade of fork: a fork mode the host cannot give raises ``CapabilityMissing`` naming the missing part
and the fix; ``fork_mode="fs"`` is had when asked for, and ``auto`` takes the best there is with one warning."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from bunshin_async import CapabilityMissing, Config, Workspace
from bunshin_async._fallback import reset_warnings
from bunshin_async._fork import _modes
from bunshin_async._host import _snapstore

pytestmark = pytest.mark.fork_modes("criu-cow")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bunshin_async" and r.levelno == logging.WARNING]


async def test_hidden_criu_raises_by_default_and_fs_works_when_asked(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BUNSHIN_FORK_MODE")  # the default mode
    assert Config.current().fork_mode == "cow"
    monkeypatch.setenv("BUNSHIN_CRIU", "/nonexistent/criu")
    await ws.spawn(["sleep", "1000"])
    with pytest.raises(CapabilityMissing, match="/nonexistent/criu") as info:
        await ws.fork(2)
    assert info.value.capability == "criu" and "bunshin setup" in info.value.remedy
    with pytest.raises(CapabilityMissing):
        await ws.snapshot()
    assert await ws.ping()  # the parent runs on; the root conftest checks nothing was left
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "fs")
    copies = await ws.fork(2)
    try:
        assert [c.fork_mode for c in copies] == ["fs", "fs"]
        for c in copies:  # the spawned process is started again in each copy
            assert "sleep 1000" in (await c.exec("ps -eo args")).stdout
    finally:
        for c in copies:
            await c.aclose()


def test_unpatched_criu_is_not_cow(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stock = tmp_path / "criu"
    stock.write_text("#!/bin/sh\necho 'Version: 4.2.1'\n")  # what a stock CRIU prints: no Features line
    stock.chmod(0o755)
    monkeypatch.setenv("BUNSHIN_CRIU", str(stock))
    monkeypatch.delenv("BUNSHIN_FORK_MODE")
    with pytest.raises(CapabilityMissing, match="0001-cow-restore") as info:
        _modes.restore_mode()
    assert info.value.capability == "criu-cow"
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "criu")  # stock CRIU, asked for: no loss
    assert _modes.restore_mode() == "criu"
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "auto")
    reset_warnings()
    assert [_modes.restore_mode() for _ in range(3)] == ["criu"] * 3
    (warning,) = _warnings(caplog)
    assert warning.startswith("criu-cow: ") and "memory sharing between copies" in warning


def test_snapshot_store_is_mounted_or_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty"  # on the disk: the check mounts the store there, as `bunshin snapstore` does
    monkeypatch.setenv("BUNSHIN_SNAPDIR", str(empty))
    try:
        assert not _modes.fs_only()
        ok, where = _snapstore.snapshot_store()
        assert ok and "tmpfs" in where
    finally:
        subprocess.run(["umount", str(empty)], check=False)
    busy = tmp_path / "busy"  # holds something: never mounted over
    busy.mkdir()
    (busy / "live-snapshot").mkdir()
    monkeypatch.setenv("BUNSHIN_SNAPDIR", str(busy))
    with pytest.raises(CapabilityMissing, match="not a tmpfs with large folios") as info:
        _modes.fs_only()
    assert info.value.capability == "snapshot store" and "bunshin snapstore" in info.value.remedy
    assert not os.path.ismount(busy)
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "auto")
    reset_warnings()
    assert not _modes.fs_only() and not _modes.fs_only()
    assert [w.split(":")[0] for w in _warnings(caplog)] == ["snapshot store"]
    monkeypatch.setenv("BUNSHIN_ALLOW_MISSING", "snapshot store")
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "cow")
    assert not _modes.fs_only()  # accepted by name
