"""The fork's file copies are checked, not trusted: a copy of the upper dir that fails (in CRIU's post-dump
notification, or into the layer store when the first copy is restored) fails the fork with ``ForkError``; it never
yields a snapshot or a workspace with missing files. A GUI workspace's upper dir holds the X server's socket and lock
files, so a copy without them would be a broken display.

Fault injection by wrapping the real copy: the wrapper makes the destination directory, as a copy cut short does,
and then runs a real copy that fails. At restore the dump's upper copy normally moves into the layer store by a
rename; the test makes that rename cross a device (as a store holding a mount point does), so the copy runs."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import anyio
import pytest

from bunshin_async import ForkError, Workspace
from bunshin_async._host import _snapstore, _tree

from .conftest import settled


@pytest.mark.parametrize("stage", ["snapshot", "restore"])
async def test_failed_upper_copy_is_fork_error(
    form: tuple[Workspace, dict[str, list[int]]], monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    parent, _ = form
    real = _tree.copy_tree  # what _snapstore's copies run (the dump's in a thread of its own: TreeCopy)
    layers = _snapstore.layers_dir()
    failed: list[Path] = []

    def copy(src: str | Path, dst: str | Path) -> int:
        src, dst = Path(src), Path(dst)
        into_layer = dst.parent == layers  # the restore's move of the dump's upper copy into the layer store
        if into_layer != (stage == "restore") or src.name != "upper":
            return real(src, dst)
        failed.append(dst)
        dst.mkdir()
        return real(src / "no-such-entry", dst)

    monkeypatch.setattr(_tree, "copy_tree", copy)
    if stage == "restore":
        real_rename = Path.rename

        def rename(self: Path, target: Any) -> Path:
            if self.name == "upper" and Path(target).parent == layers:
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            return real_rename(self, target)

        monkeypatch.setattr(Path, "rename", rename)
    before = await settled(parent)
    with pytest.raises(ForkError, match=r"copying \S+/upper to \S+ failed") as info:
        copies = await parent.fork(2)
        for ws in copies:  # only reached if the fork wrongly succeeded
            await ws.aclose()
    assert failed, "the copy was never made"
    assert info.value.workspace_id
    # The parent keeps running with its display, and nothing of the failed fork is left (root conftest).
    monkeypatch.undo()
    assert (await parent.gui.screenshot()).digest == before
    [ok] = await parent.fork(1)
    try:
        assert (await ok.gui.screenshot()).digest == before
        assert (await ok.exec(["test", "-S", "/tmp/.X11-unix/X0"])).exit_code == 0
    finally:
        with anyio.CancelScope(shield=True):
            await ok.aclose()
