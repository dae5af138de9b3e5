"""Snapshots pulled from other hosts into this one, as streams of ``bunshin_async.transfer`` frames (checked and
installed here, nothing half-imported on failure), and the bandwidth each transfer measured (the placement's cost
model uses it). A host's own copy of a source snapshot is fetched once and handed out again."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from ..._fork._snapshot import Snapshot
from ..._fork._transfer import TransferStats, import_snapshot
from ._holdings import Holdings, snapshot_bytes
from ._placement import mean_update
from ._remote import pull


class KeyedLocks:
    """One lock per key, there only while someone holds or waits on it: a host fetches snapshots for as long as it
    runs, and a lock kept per key it ever fetched would grow without bound."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[anyio.Lock, list[int]]] = {}  # key -> (lock, [holders and waiters])

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(key, (anyio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:  # also a waiter cancelled before it got the lock
            users[0] -= 1
            if not users[0]:
                del self._locks[key]

    def users(self, key: str) -> int:
        """How many hold or wait on ``key``'s lock."""
        entry = self._locks.get(key)
        return 0 if entry is None else entry[1][0]

    def __len__(self) -> int:
        return len(self._locks)


class Fetches:
    """The fetches of the host whose holdings are ``held``; ``lookup`` finds a snapshot the host holds by id (or
    raises)."""

    def __init__(self, held: Holdings, lookup: Callable[[str], Snapshot]) -> None:
        self.held = held
        self.lookup = lookup
        self.fetched: dict[str, str] = {}  # "<source host>/<snapshot id>" -> local snapshot id (the host's own)
        self.bandwidth: dict[str, float] = {}  # source host -> bytes/s of transfers from it (a running mean)
        self.locks = KeyedLocks()  # one fetch per source snapshot at a time

    async def fetch(
        self, source: Any, source_name: str, snap_id: str, owner: str | None
    ) -> tuple[str, int, TransferStats | None]:
        """Pull snapshot ``snap_id`` from host ``source_name`` (``source``: its actor) here: ``(local id, bytes,
        stats)``, stats None when nothing moved. With ``owner`` None it is the host's own copy, remembered and
        handed out again for the same source snapshot; otherwise a copy leased to ``owner``."""
        key = f"{source_name}/{snap_id}"
        if source_name == self.held.name:
            return snap_id, await snapshot_bytes(self.lookup(snap_id)), None
        async with self.locks.hold(key):
            known = self.fetched.get(key)
            if known is not None and self.held.snapshot(known) is not None and owner is None:
                return known, await snapshot_bytes(self.lookup(known)), None
            snap, stats = await import_snapshot(pull(source, source_name, snap_id))
            self.held.adopt_snapshot(snap, owner)
            if owner is None:
                self.fetched[key] = snap.id
            self.bandwidth[source_name] = mean_update(self.bandwidth.get(source_name), stats.bandwidth, 0.5)
            return snap.id, stats.bytes, stats

    def forget(self) -> list[str]:
        """The ids of the host's own copies, forgotten here (the host closes them)."""
        ids = list(self.fetched.values())
        self.fetched.clear()
        return ids
