"""The fork's file copies are checked, not trusted: a copy of the upper dir that fails (in CRIU's post-dump
notification, or into a new copy at restore) fails the fork with ``ForkError``; it never yields a snapshot or a
workspace with missing files. A GUI workspace's upper dir holds the X server's socket and lock files, so a copy
without them would be a broken display.

Fault injection by wrapping the real copy: the wrapper makes the destination directory, as a copy cut short does,
and then runs a real ``cp`` that fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from bunshin_async import ForkError, Workspace
from bunshin_async._fork import _layers

from .conftest import settled


@pytest.mark.parametrize("stage", ["snapshot", "restore"])
async def test_failed_upper_copy_is_fork_error(
    form: tuple[Workspace, dict[str, list[int]]], monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    parent, _ = form
    real = _layers.copy_tree
    failed: list[Path] = []

    async def copy(src: Path, dst: Path, **kw: Any) -> None:
        into_snapshot = dst.parent.parent == _layers.snapshot_dir()
        if into_snapshot != (stage == "snapshot"):
            return await real(src, dst, **kw)
        failed.append(dst)
        dst.mkdir()
        await real(src / "no-such-entry", dst, **kw)

    monkeypatch.setattr(_layers, "copy_tree", copy)
    before = await settled(parent)
    with pytest.raises(ForkError, match="no-such-entry") as info:
        copies = await parent.fork(2)
        for ws in copies:  # only reached if the fork wrongly succeeded
            await ws.aclose()
    assert failed, "the copy was never made"
    assert info.value.workspace_id
    # The parent keeps running with its display, and nothing of the failed fork is left (root conftest).
    monkeypatch.setattr(_layers, "copy_tree", real)
    assert (await parent.gui.screenshot()).digest == before
    [ok] = await parent.fork(1)
    try:
        assert (await ok.gui.screenshot()).digest == before
        assert (await ok.exec(["test", "-S", "/tmp/.X11-unix/X0"])).exit_code == 0
    finally:
        with anyio.CancelScope(shield=True):
            await ok.aclose()
