"""The on-disk store: one SQLite database in WAL mode, shared by every process of a host.

Each put is one atomic transaction, so a process killed mid-write leaves the database at its last commit (SQLite's
rollback of an uncommitted WAL tail on the next open, https://sqlite.org/wal.html). ``synchronous=NORMAL`` keeps
commits across a process crash; ``durable=True`` (``synchronous=FULL``) keeps them across a power loss as well.
Readers never block writers in WAL mode; writers of several processes queue on ``busy_timeout``.

SQLite calls block, so they run in a worker thread, one at a time per store (a ``CapacityLimiter(1)``).
Recency for LRU eviction is recorded lazily: hits are batched and written with the next put.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import anyio
import msgspec

from .._exceptions import StoreUnavailable
from ._store import StoreStats

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key   BLOB PRIMARY KEY,
    value BLOB NOT NULL,
    size  INTEGER NOT NULL,
    atime REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_atime ON entries (atime);
"""
_TOUCH_BATCH = 256


class SqliteStore:
    """Entries in ``path`` (created if missing), evicted least-recently-used beyond ``max_bytes`` (values and keys,
    summed over every process that shares the file)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = 4 << 30,
        durable: bool = False,
        busy_timeout: float = 5.0,
        name: str = "sqlite",
    ) -> None:
        self.name = name
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)
        self._stats = StoreStats(name=name)
        self._touched: dict[bytes, float] = {}
        self._closed = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
            self._db.executescript(_SCHEMA)
            total, count = self._db.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM entries").fetchone()
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"cannot open the cache database {self.path}: {exc}", store=name) from exc
        self._stats.bytes, self._stats.entries = int(total), int(count)

    async def _run(self, fn: Callable[[], T]) -> T:
        if self._closed:
            raise StoreUnavailable(f"the cache database {self.path} is closed", store=self.name)

        def locked() -> T:
            with self._lock:
                return fn()

        try:
            return await anyio.to_thread.run_sync(locked, limiter=self._limiter)
        except sqlite3.Error as exc:
            self._stats.errors += 1
            raise StoreUnavailable(f"cache database {self.path}: {exc}", store=self.name) from exc

    async def get(self, key: bytes) -> bytes | None:
        row = await self._run(lambda: self._db.execute("SELECT value FROM entries WHERE key = ?", (key,)).fetchone())
        if row is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._touched[key] = time.time()
        if len(self._touched) >= _TOUCH_BATCH:
            await self._run(self._flush_touched)
        return bytes(row[0])

    def _flush_touched(self) -> None:
        if not self._touched:
            return
        touched, self._touched = self._touched, {}
        self._db.executemany("UPDATE entries SET atime = ? WHERE key = ?", [(t, k) for k, t in touched.items()])

    async def put(self, key: bytes, value: bytes) -> None:
        size = len(key) + len(value)

        def txn() -> None:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._flush_touched()
                old = self._db.execute("SELECT size FROM entries WHERE key = ?", (key,)).fetchone()
                self._db.execute(
                    "INSERT OR REPLACE INTO entries (key, value, size, atime) VALUES (?, ?, ?, ?)",
                    (key, value, size, time.time()),
                )
                self._stats.bytes += size - (old[0] if old else 0)
                self._stats.entries += 0 if old else 1
                if self._stats.bytes > self.max_bytes:
                    self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

        await self._run(txn)
        self._stats.puts += 1

    def _evict(self) -> None:
        # Other processes write to the same file: recount before deciding how much to drop.
        total, count = self._db.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM entries").fetchone()
        target = int(self.max_bytes * 0.9)
        if total > self.max_bytes:
            rows = self._db.execute("SELECT key, size FROM entries ORDER BY atime").fetchall()
            drop = []
            for k, s in rows:
                if total <= target:
                    break
                drop.append((k,))
                total -= s
            self._db.executemany("DELETE FROM entries WHERE key = ?", drop)
            self._stats.evictions += len(drop)
            count -= len(drop)
        self._stats.bytes, self._stats.entries = int(total), int(count)

    async def delete(self, key: bytes) -> None:
        def txn() -> None:
            row = self._db.execute("DELETE FROM entries WHERE key = ? RETURNING size", (key,)).fetchone()
            if row is not None:
                self._stats.bytes -= row[0]
                self._stats.entries -= 1
                self._stats.deletes += 1

        await self._run(txn)

    def stats(self) -> StoreStats:
        return msgspec.structs.replace(self._stats)

    async def aclose(self) -> None:
        if self._closed:
            return

        def close() -> None:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._flush_touched()
                self._db.execute("COMMIT")
            except sqlite3.Error:
                pass
            self._db.close()

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(lambda: self._locked(close), limiter=self._limiter)
        self._closed = True

    def _locked(self, fn: Callable[[], None]) -> None:
        with self._lock:
            fn()
