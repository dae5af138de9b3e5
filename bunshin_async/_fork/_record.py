"""``SnapshotRecord``: what the restore side of the fork layer (``_restore``, ``_spares``, ``_quiesce``) needs of a
snapshot. ``Snapshot`` (``_snapshot``) is its one implementation; it sits above them, because the public class
builds a ``SparePool`` (``keep_spares``), which restores. Seeing the snapshot through this interface keeps the layers
pointing down: nothing below ``_snapshot`` imports it, not even for annotations."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .._workspace._core import SetupStep, WorkspaceCore, WorkspaceSpec

__all__ = ["SnapshotRecord", "Spares"]


class Spares(Protocol):
    """Warm spares of a snapshot (``SparePool``), as a restore takes them."""

    def take(self, n: int) -> list[WorkspaceCore]: ...

    async def aclose(self) -> None: ...


class SnapshotRecord(Protocol):
    """A snapshot in the store (see ``Snapshot`` for what each member means)."""

    id: str
    workspace_id: str
    mode: str
    setup: list[tuple[SetupStep, int]]
    path: Path
    parent_lower: str
    lower: str
    spec: WorkspaceSpec
    fresh_net: bool
    spares: Spares | None

    @property
    def closed(self) -> bool: ...

    @property
    def images(self) -> Path: ...

    @property
    def layer(self) -> Path: ...

    async def materialize(self) -> None: ...

    async def aclose(self) -> None: ...
