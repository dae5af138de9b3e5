"""``SnapshotRecord``: a snapshot as the fork layer sees it (its directory, layer chain, the workspace's spec, the
spares kept of it). The public ``Snapshot`` (``_snapshot``) wraps one and shows only what a user needs; it sits above
``_restore``, ``_spares`` and ``_quiesce``, because it builds a ``SparePool`` (``keep_spares``), which restores, and
they work on the record, so the layers point down."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Protocol

import anyio

from .._exceptions import ForkError, TransferError
from .._host import _snapstore, _tree
from .._host._snapstore import chain_layers, layers_dir, release_layers, snapshot_dir
from .._images._image import Image
from .._workspace._core import SetupStep, WorkspaceCore, WorkspaceSpec

__all__ = ["SnapshotRecord", "Spares"]


class Spares(Protocol):
    """Warm spares of a snapshot (``SparePool``), as a restore takes them."""

    def take(self, n: int) -> list[WorkspaceCore]: ...

    async def aclose(self) -> None: ...


class SnapshotRecord:
    """A frozen moment of a workspace in the store: CRIU images and the upper dir (a layer, see the package doc);
    for ``mode == "fs"`` only the upper dir and the recorded setup (``setup``), no images. Owns its directory;
    ``aclose()`` removes it and lets go of its layers (idempotent). Workspaces restored from it do not need it
    afterwards. ``lower`` is the full lowerdir chain a copy mounts under its empty upper. The fork layer's view;
    users hold the ``Snapshot`` around it."""

    def __init__(
        self,
        *,
        workspace_id: str,
        parent_lower: str,
        spec: WorkspaceSpec,
        mode: str = "criu",
        setup: list[tuple[SetupStep, int]] | None = None,
    ) -> None:
        self.id = secrets.token_hex(6)
        self.workspace_id = workspace_id
        self.mode = mode
        """``"criu"`` (CRIU images: a live fork) or ``"fs"`` (files and ``setup`` only, see the module doc)."""
        self.setup = list(setup or [])
        """The workspace's recorded spawns with their in-workspace pids (for ``"fs"``: those still running)."""
        self.path = snapshot_dir() / self.id
        self.parent_lower = parent_lower
        self.lower = f"{self.layer}:{parent_lower}"
        self._layer_lock = anyio.Lock()
        self.spec = spec
        """How the workspace was made (its ``env`` a copy): what each copy gets."""
        self.upper_bytes: int | None = None
        """The bytes the dump's copy of the upper dir holds, tallied by the copy (``_tree.Copied``); ``None`` for a
        record that made no copy (an imported one)."""
        self.dump_ms: float | None = None
        self.rebase_ms: float | None = None
        """How long the workspace's restore from this snapshot took when its dump re-based it (``_restore.rebase``):
        part of the workspace's pause, after ``dump_ms``."""
        self.frozen_ms: float | None = None
        self.fresh_net = False
        """The net namespace was left out of the images (``plain_netns``): each copy gets a fresh loopback-only one."""
        self._closed = False
        self.spares: Spares | None = None
        """The pool keeping warm spares of this snapshot (``keep_spares``), while one does."""

    @property
    def image(self) -> Image:
        assert self.spec.image is not None  # a running workspace's image is resolved
        return self.spec.image

    @property
    def images(self) -> Path:
        return self.path / "images"

    @property
    def upper(self) -> Path:
        """The upper dir as copied at the dump (on tmpfs: short freeze); the first restore turns it into ``layer``."""
        return self.path / "upper"

    @property
    def layer(self) -> Path:
        """The upper copy as a read-only overlay layer on the workspaces' filesystem (made by the first restore)."""
        return layers_dir() / self.id

    async def materialize(self) -> None:
        """Make the dump's upper copy the layer ``layer``, once: a rename within the snapshot store (a copy where
        the store holds another filesystem)."""
        async with self._layer_lock:
            if self.layer.is_dir():
                return
            if self.closed:
                raise ForkError(f"snapshot {self.id} is closed", workspace_id=self.workspace_id)
            partial = self.layer.with_name(f"{self.id}.partial")
            try:
                partial.parent.mkdir(parents=True, exist_ok=True)
                try:  # the layers are in the snapshot store: the upper copy moves in place
                    self.upper.rename(self.layer)
                except OSError as exc:
                    if exc.errno != errno.EXDEV:  # a store with a mount point inside: copy
                        raise ForkError(
                            f"snapshot {self.id}: its upper copy cannot become a layer: {exc.strerror}",
                            workspace_id=self.workspace_id,
                        ) from exc
                    await _snapstore.copy_tree(self.upper, partial, workspace_id=self.workspace_id)
                    partial.rename(self.layer)
            finally:
                with anyio.CancelScope(shield=True):
                    if partial.exists():
                        await anyio.to_thread.run_sync(_tree.discard, partial)
            await anyio.to_thread.run_sync(_tree.discard, self.upper)

    def stored_bytes(self) -> int:
        """The bytes this snapshot holds in the store (blocking): its own files (CRIU's images, a flat directory CRIU
        wrote, and the record's files beside them: no tree of the workspace's) plus the upper dir's copy as its copy
        tallied it (``upper_bytes``), so that no one walks the workspace's tree again to size it. What a record
        without a tally holds is walked (from descriptors, ``_tree.walk``)."""
        if self.upper_bytes is None:
            walked = 0
            with contextlib.suppress(OSError):  # gone: what was counted
                for e in _tree.walk(self.path):
                    walked += 0 if stat.S_ISDIR(e.st.st_mode) else e.st.st_blocks * 512
            return walked
        total = self.upper_bytes
        for d in (self.path, self.images):
            try:
                with os.scandir(d) as entries:
                    files = [e for e in entries if e.is_file(follow_symlinks=False)]
                    total += sum(e.stat(follow_symlinks=False).st_blocks * 512 for e in files)
            except OSError:  # no images (a filesystem-only snapshot), or gone: what was counted
                pass
        return total

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self.spares is not None:
                await self.spares.aclose()
            await anyio.to_thread.run_sync(_tree.discard, self.upper)
            # The directory itself goes with its last user: CoW copies map its pages image and incremental
            # images of their own memory refer to it (``release_layers``).
            await anyio.to_thread.run_sync(release_layers, [self.path, *chain_layers(self.lower)], self.holder)

    @property
    def holder(self) -> str:
        """The name this snapshot holds its layers and directory under (``hold_layers``)."""
        return f"snapshot-{self.id}"

    @classmethod
    def adopt(cls, snap_id: str, *, lower: str, fresh_net: bool = False, **record: Any) -> SnapshotRecord:
        """A record for a directory ``snap_id`` already in the store whose layers are in place (an
        imported one, ``bunshin_async._fork._transfer``); the caller holds its references (``hold_layers``). ``lower``
        is its full chain, its own layer first; ``record`` the keyword arguments of ``__init__`` but the chain."""
        own, _, parent_lower = lower.partition(":")
        snap = cls(parent_lower=parent_lower, **record)
        snap.id = snap_id
        snap.path = snapshot_dir() / snap_id
        snap.lower = lower
        snap.fresh_net = fresh_net
        if own != str(snap.layer):
            raise TransferError(
                f"lower chain {lower!r} does not start with the layer of {snap_id}", snapshot_id=snap_id
            )
        return snap
