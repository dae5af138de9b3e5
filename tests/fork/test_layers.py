"""A copy's files are a fresh upper over the snapshot's upper copy as a read-only layer (no copy per restore). The
layers outlive the snapshot and the parent as long as a copy stands on them, forks of forks stack, rollback swaps the
chain, a chain past ``MAX_LAYERS`` is flattened by one copy, and the last user deletes a layer (the root conftest
checks that nothing is left)."""

from __future__ import annotations

import pytest

from bunshin_async import Workspace
from bunshin_async._fork import _restore
from bunshin_async._host import _snapstore as store

pytestmark = pytest.mark.fork_modes("criu-cow")  # the file layers are the same for every restore mode


def _layers() -> set[str]:
    d = store.layers_dir()
    return {p.name for p in d.iterdir() if not p.name.endswith(".users")} if d.exists() else set()


async def test_layers_outlive_snapshot_and_parent(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    await ws.exec("mkdir /workspace/d && echo p > /workspace/d/f && rm /etc/hostname")
    [a] = await ws.fork(1)  # its snapshot is closed already
    try:
        assert len(store.chain_layers(a._core.lower or "")) == 1 and len(_layers()) == 1
        await a.write_file("/workspace/d/f", "a")
        [b] = await a.fork(1)
    finally:
        await a.aclose()
    try:
        assert len(store.chain_layers(b._core.lower or "")) == 2 and len(_layers()) == 2
        assert await b.read_text("/workspace/d/f") == "a"
        assert (await b.exec("test -e /etc/hostname")).exit_code == 1
        assert await ws.read_text("/workspace/d/f") == "p\n"
        # Rollback: the chain becomes the snapshot's, the old top layer goes once nobody stands on it.
        async with await b.snapshot() as snap:
            await b.write_file("/workspace/d/f", "b")
            await b.rollback(snap)
        assert await b.read_text("/workspace/d/f") == "a"
        assert len(store.chain_layers(b._core.lower or "")) == 3
        # Past MAX_LAYERS a restore copies the top layer into the upper instead of stacking it.
        monkeypatch.setattr(_restore, "MAX_LAYERS", 4)
        [c] = await b.fork(1)
        try:
            assert c._core.lower == b._core.lower and await c.read_text("/workspace/d/f") == "a"
        finally:
            await c.aclose()
    finally:
        await b.aclose()
    assert not _layers()


STAT = "cd /workspace && stat -c %s d e && cat d/a && echo $(ls d) / $(ls e)"


async def test_directory_sizes_count_the_topmost_layers_entries(ws: Workspace) -> None:
    """The one difference a copy shows (docs/security.md, Disk): a directory's size is its topmost layer's, on tmpfs
    40 bytes plus 20 per entry. A copy's layer holds what its parent had; once the copy writes into a directory,
    overlayfs copies it up empty, so it counts the copy's own entries only (a whiteout among them), while the files
    stay the same."""
    await ws.exec("cd /workspace && mkdir d e && echo a > d/a && touch d/b e/x")
    assert (await ws.exec(STAT)).stdout.split("\n") == ["80", "60", "a", "a b / x", ""]
    [copy] = await ws.fork(1)
    try:
        assert (await copy.exec(STAT)).stdout.split("\n") == ["80", "60", "a", "a b / x", ""]  # the parent's layer
        step = "touch /workspace/d/z && rm /workspace/e/x"
        assert (await ws.exec(step)).exit_code == 0 and (await copy.exec(step)).exit_code == 0
        assert (await ws.exec(STAT)).stdout.split("\n") == ["100", "40", "a", "a b z /", ""]
        assert (await copy.exec(STAT)).stdout.split("\n") == ["60", "60", "a", "a b z /", ""]  # z; x's whiteout
    finally:
        await copy.aclose()
