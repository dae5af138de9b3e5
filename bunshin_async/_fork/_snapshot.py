"""``Snapshot``: a frozen moment of a workspace, as a user holds it (package doc). What the fork layer needs of it
(directory, layer chain, spec) is its ``SnapshotRecord`` (``_record``), reached through ``record_of``."""

from __future__ import annotations

from typing import Any

from .._images._image import Image
from .._workspace._core import SetupStep
from ._record import SnapshotRecord
from ._spares import SparePool

__all__ = ["Snapshot", "record_of"]


class Snapshot:
    """A frozen moment of a workspace: its processes (CRIU images) and files, or for ``mode == "fs"`` its files and
    recorded spawns only. Copies come from ``Workspace.from_snapshot(snap, n)``; ``keep_spares(k)`` keeps warm ones.
    Owns its place in the snapshot store: ``aclose()`` (or leaving ``async with``) removes it (idempotent);
    workspaces restored from it do not need it afterwards."""

    def __init__(self, record: SnapshotRecord) -> None:
        self._record = record

    @property
    def id(self) -> str:
        return self._record.id

    @property
    def workspace_id(self) -> str:
        """The workspace it was taken of."""
        return self._record.workspace_id

    @property
    def mode(self) -> str:
        """``"criu"`` (CRIU images: a live fork) or ``"fs"`` (files and ``setup`` only, see the package doc)."""
        return self._record.mode

    @property
    def setup(self) -> list[tuple[SetupStep, int]]:
        """The workspace's recorded spawns with their in-workspace pids (for ``"fs"``: those still running)."""
        return list(self._record.setup)

    @property
    def image(self) -> Image:
        """The image the workspace runs on."""
        return self._record.image

    @property
    def dump_ms(self) -> float | None:
        """How long the CRIU dump paused the workspace, as its calls see it: from the drain's start, when new calls
        are held (calls in flight are waited for within it; CRIU, started before, waiting), to CRIU's answer, when
        the tree is thawed and the held calls go on (its exit and reaping come after; None for ``"fs"``)."""
        return self._record.dump_ms

    @property
    def frozen_ms(self) -> float | None:
        """How long the workspace was frozen for an ``"fs"`` snapshot's copy (None for ``"criu"``)."""
        return self._record.frozen_ms

    @property
    def closed(self) -> bool:
        return self._record.closed

    def keep_spares(self, k: int) -> SparePool:
        """A pool keeping ``k`` frozen, pre-restored copies for ``Workspace.from_snapshot`` to hand out in
        milliseconds (``async with snap.keep_spares(k):``; see ``bunshin_async._fork._spares``)."""
        return SparePool(self._record, k)

    async def aclose(self) -> None:
        await self._record.aclose()

    async def __aenter__(self) -> Snapshot:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} of {self.workspace_id}>"

    @classmethod
    def adopt(cls, snap_id: str, *, lower: str, fresh_net: bool = False, **record: Any) -> Snapshot:
        """A ``Snapshot`` for a directory ``snap_id`` already in the store (``SnapshotRecord.adopt``)."""
        return cls(SnapshotRecord.adopt(snap_id, lower=lower, fresh_net=fresh_net, **record))


def record_of(snap: Snapshot) -> SnapshotRecord:
    """What the fork layer works on (and the cache and a cluster host measure): the snapshot's record."""
    return snap._record
