"""Snapshots that move between hosts: ``export_snapshot`` turns a snapshot into an integrity-checked byte stream,
``import_snapshot`` makes it a snapshot of this host's store that ``Workspace.from_snapshot`` restores (copies
share its memory pages copy-on-write, as with a local one)::

    from bunshin_async.transfer import export_snapshot, import_snapshot

    async with await ws.snapshot() as snap:
        frames = [frame async for frame in export_snapshot(snap)]   # or send them: a socket, Ray, a file
    snap2, stats = await import_snapshot(iter_frames())              # on the other host
    copies = await Workspace.from_snapshot(snap2, 4)

See ``bunshin_async._fork._transfer`` for the stream format and what is checked.
"""

from __future__ import annotations

from ._fork._transfer import FORMAT, SnapshotRecord, TransferStats, export_snapshot, import_snapshot, snapshot_record
from ._public import publish as _publish

__all__ = ["FORMAT", "SnapshotRecord", "TransferStats", "export_snapshot", "import_snapshot", "snapshot_record"]

_publish(__name__, globals())
