"""The stores: in-memory LRU, SQLite (crash safety, corruption), layered, Redis (outage and reconnect)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from bunshin_async._cache._records import Entry, seal, unseal
from bunshin_async.cache import CacheWarning, LayeredStore, MemoryStore, RedisStore, SqliteStore

from .conftest import RedisServer


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.mark.unit
async def test_memory_store_is_a_bounded_lru() -> None:
    store = MemoryStore(max_bytes=3 * (16 + 100))
    for i in range(3):
        await store.put(k(i), b"x" * 100)
    assert await store.get(k(0)) is not None  # 0 is now the most recent
    await store.put(k(3), b"y" * 100)
    assert await store.get(k(1)) is None
    assert await store.get(k(0)) == b"x" * 100
    s = store.stats()
    assert s.entries == 3 and s.bytes == 3 * 116 and s.evictions == 1
    await store.put(k(9), b"z" * 10_000)  # larger than the budget: not stored, nothing evicted
    assert await store.get(k(9)) is None and store.stats().entries == 3
    await store.delete(k(0))
    assert await store.get(k(0)) is None


@pytest.mark.unit
async def test_sqlite_store_roundtrip_eviction_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    store = SqliteStore(path, max_bytes=10 * 1016)
    for i in range(10):
        await store.put(k(i), bytes([i]) * 1000)
    for i in range(1, 10):
        assert await store.get(k(i)) is not None  # 0 is the least recently used
    await store.put(k(10), b"n" * 1000)
    s = store.stats()
    assert s.evictions >= 1 and s.bytes <= 10 * 1016
    assert await store.get(k(0)) is None
    assert await store.get(k(10)) == b"n" * 1000
    await store.delete(k(10))
    await store.aclose()
    await store.aclose()  # idempotent
    again = SqliteStore(path)
    assert await again.get(k(9)) == bytes([9]) * 1000
    assert await again.get(k(10)) is None
    await again.aclose()


@pytest.mark.unit
async def test_sqlite_store_is_shared_between_processes(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    a, b = SqliteStore(path), SqliteStore(path)
    await a.put(k(1), b"from a")
    assert await b.get(k(1)) == b"from a"
    await a.aclose()
    await b.aclose()


WRITER = textwrap.dedent(
    """
    import sys, anyio, time
    from bunshin_async._cache._sqlite import SqliteStore
    from bunshin_async._cache._records import Entry, seal

    async def main():
        store = SqliteStore(sys.argv[1], max_bytes=1 << 40)
        i = 0
        while True:
            key = i.to_bytes(16, "big")
            entry = Entry("bash", "read", None, 0.1, time.time(), error=None)
            await store.put(key, seal(key, entry))
            await store.put(key + b"big", bytes([i % 256]) * (256 << 10))
            print(i, flush=True)
            i += 1

    anyio.run(main)
    """
)


def _write_until_killed(path: Path, at_least: int) -> int:
    """Run WRITER, SIGKILL it after ``at_least`` commits; returns the last index it reported committed."""
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, cwd=Path(__file__).parents[2]
    ) as proc:
        assert proc.stdout is not None
        committed = -1
        deadline = time.monotonic() + 20
        while committed < at_least and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "writer died"
            committed = int(line)
        os.kill(proc.pid, signal.SIGKILL)  # most likely in the middle of a 256 KiB transaction
        proc.wait()
        # Lines printed after we stopped reading are committed too.
        return max([committed, *(int(x) for x in proc.stdout.read().split())])


@pytest.mark.unit
@pytest.mark.slow
async def test_sqlite_store_survives_sigkill_mid_write(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    committed = await anyio.to_thread.run_sync(_write_until_killed, path, 150)
    assert committed >= 150

    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()
    store = SqliteStore(path)
    for i in range(committed + 1):
        key = k(i)
        value = await store.get(key)
        assert value is not None, f"committed entry {i} lost"
        unseal(key, value)  # raises if corrupt
        big = await store.get(key + b"big")
        assert big == bytes([i % 256]) * (256 << 10)
    await store.put(k(10**6), b"still writable")
    assert await store.get(k(10**6)) == b"still writable"
    await store.aclose()


@pytest.mark.unit
async def test_layered_store_backfills_upper_layers(tmp_path: Path) -> None:
    mem, disk = MemoryStore(), SqliteStore(tmp_path / "c.db")
    store = LayeredStore(mem, disk)
    await disk.put(k(1), b"on disk")
    assert await mem.get(k(1)) is None
    assert await store.get(k(1)) == b"on disk"
    assert await mem.get(k(1)) == b"on disk"
    await store.put(k(2), b"both")
    assert await mem.get(k(2)) == await disk.get(k(2)) == b"both"
    await store.delete(k(2))
    assert await mem.get(k(2)) is None and await disk.get(k(2)) is None
    s = store.stats()
    assert [layer.name for layer in s.layers] == ["memory", "sqlite"]
    await store.aclose()


async def test_redis_store_roundtrip(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, prefix=b"t-roundtrip:")
    await store.put(k(1), b"shared")
    other = RedisStore(redis_server.url, prefix=b"t-roundtrip:")
    assert await other.get(k(1)) == b"shared"
    await other.delete(k(1))
    assert await store.get(k(1)) is None
    assert store.stats().available
    await store.aclose()
    await other.aclose()


async def test_redis_outage_degrades_with_one_warning_and_reconnects(own_redis: RedisServer) -> None:
    redis = RedisStore(own_redis.url, retry_interval=0.05, socket_timeout=0.5)
    store = LayeredStore(MemoryStore(), redis)
    await store.put(k(1), b"before")

    own_redis.stop()
    with pytest.warns(CacheWarning) as caught:
        for i in range(20):  # keeps working: memory answers, Redis is skipped
            assert await store.get(k(1)) == b"before"
            assert await redis.get(k(100 + i)) is None
            await store.put(k(100 + i), b"during")
            await anyio.sleep(0.01)
    assert len([w for w in caught if issubclass(w.category, CacheWarning)]) == 1
    assert not redis.stats().available

    await anyio.to_thread.run_sync(own_redis.start)  # same port and AOF directory
    deadline = time.monotonic() + 5
    while not await redis.ping():
        assert time.monotonic() < deadline
        await anyio.sleep(0.05)
    assert redis.stats().available
    fresh = RedisStore(own_redis.url)
    assert await fresh.get(k(1)) == b"before"  # kept across the restart (AOF)
    for i in range(20):
        assert await fresh.get(k(100 + i)) == b"during"  # queued while down, written on reconnect
    await store.put(k(2), b"after")
    assert await fresh.get(k(2)) == b"after"
    await fresh.aclose()
    await store.aclose()


@pytest.mark.unit
async def test_corrupt_records_are_detected() -> None:
    key = k(7)
    entry = Entry("bash", "read", None, 1.0, 0.0)
    value = seal(key, entry)
    assert unseal(key, value) == entry
    from bunshin_async._cache._records import CorruptRecord

    for bad in (value[:-3], value[:5], b"", value[:-1] + bytes([value[-1] ^ 1]), b"\x93\x01\x02\x03"):
        with pytest.raises(CorruptRecord):
            unseal(key, bad)
    with pytest.raises(CorruptRecord):
        unseal(k(8), value)  # stored under another key
