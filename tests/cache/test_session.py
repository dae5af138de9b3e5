"""``ToolCache`` and ``CachedSession`` on real workspaces."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from bunshin_async import FileNotFound, ForkError, ToolCallError, Workspace
from bunshin_async._cache._state import StateTree
from bunshin_async._host._snapstore import layers_dir, snapshot_dir
from bunshin_async.cache import (
    CachedSession,
    ForkStateProvider,
    MemoryStore,
    RedisStore,
    SnapshotRef,
    SqliteStore,
    Store,
    ToolCache,
)
from bunshin_async.tools import Effect, Tool, builtin_tools, read_file_tool

from .conftest import RedisServer

pytestmark = pytest.mark.usefixtures("need_workspaces")


@asynccontextmanager
async def workspaces(n: int) -> AsyncIterator[list[Workspace]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(Workspace()) for _ in range(n)]


def sources(session: CachedSession) -> list[str]:
    return [r.source for r in session.history]


async def test_reads_in_permuted_order_hit() -> None:
    async with ToolCache() as cache, workspaces(2) as (ws1, ws2):
        a, b = cache.session(ws1), cache.session(ws2)
        for s in (a, b):
            await s.call("write_file", {"path": "a.txt", "content": "alpha\n"})
            await s.call("bash", {"command": "mkdir -p d && echo beta > d/b.txt"})
        reads: list[tuple[str, dict[str, Any]]] = [
            ("read_file", {"path": "a.txt"}),
            ("list_dir", {"path": "d"}),
            ("bash", {"command": "cat d/b.txt a.txt | wc -l"}),
            ("bash", {"command": "grep -rn beta ."}),
        ]
        first = [await a.call(t, args) for t, args in reads]
        second = [await b.call(t, args) for t, args in reversed(reads)][::-1]
        assert sources(b) == ["executed", "executed"] + ["cache"] * 4, (sources(a), sources(b))
        assert first == second
        assert first[0] == "alpha\n" and first[2].stdout.strip() == "2"
        assert sources(b) == ["executed", "executed"] + ["cache"] * 4
        assert a.state == b.state
        m = cache.metrics()
        assert m.by_effect["read"].hits == 4 and m.by_effect["read"].misses == 4
        assert m.by_tool["bash"].hits == 2 and m.saved_seconds > 0
        assert m.write_hits_unserved == 2  # b's writes were in the cache, but no provider can restore them


async def test_changed_tool_version_misses() -> None:
    async with ToolCache() as cache, workspaces(1) as (ws,):
        v1 = cache.session(ws, [read_file_tool(version="1")])
        v2 = cache.session(ws, [read_file_tool(version="2")])
        again = cache.session(ws, [read_file_tool(version="1")])
        await ws.write_file("h", "bunshin\n")
        for s in (v1, v2, again):
            assert await s.call("read_file", {"path": "h"}) == "bunshin\n"
        assert sources(v1) == ["executed"] and sources(v2) == ["executed"] and sources(again) == ["cache"]


async def test_a_write_advances_the_chain() -> None:
    async with ToolCache() as cache, workspaces(3) as (ws1, ws2, ws3):
        one, two, one_again = cache.session(ws1), cache.session(ws2), cache.session(ws3)
        root = one.state
        assert one.state == two.state
        await one.call("bash", {"command": "cat /etc/hostname"})
        assert one.state == root  # a read does not advance
        await one.call("write_file", {"path": "x", "content": "1"})
        await two.call("write_file", {"path": "x", "content": "2"})
        await one_again.call("write_file", {"path": "x", "content": "1"})
        assert one.state != root and one.state != two.state and one.state == one_again.state
        assert await one.call("read_file", {"path": "x"}) == "1"
        assert await two.call("read_file", {"path": "x"}) == "2"  # a different write before it: a miss
        assert await one_again.call("read_file", {"path": "x"}) == "1"
        assert [s.history[-1].source for s in (one, two, one_again)] == ["executed", "executed", "cache"]


async def test_concurrent_identical_calls_run_once() -> None:
    executions = 0

    async def slow_probe(ws: Workspace, args: dict[str, Any]) -> str:
        nonlocal executions
        executions += 1
        r = await ws.exec(f"sleep 0.3; cat {args['path']}", timeout=10)
        return r.stdout

    probe = Tool(
        name="probe",
        schema={"type": "object", "properties": {"path": {"type": "string"}}},
        effect=Effect.READ,
        handler=slow_probe,
        result_type=str,
    )
    async with ToolCache() as cache, workspaces(8) as wss:
        sessions = [cache.session(ws, [probe, *builtin_tools()]) for ws in wss]
        results: list[str] = [""] * 8

        async def run(i: int) -> None:
            results[i] = await sessions[i].call("probe", {"path": "/etc/hostname"})

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(run, i)
        assert executions == 1
        assert results == ["bunshin\n"] * 8
        assert sorted(sources(s)[0] for s in sessions) == ["executed"] + ["shared"] * 7
        assert cache.metrics().by_tool["probe"].shared == 7

        # The same through the shell, counting executions inside the workspace: 8 sessions on one workspace,
        # the command forced to `read` (it appends to a counter file, which a real read would not).
        counted = [cache.session(wss[0]) for _ in range(8)]
        cmd = {"command": "echo x >> /tmp/runs; sleep 0.3; cat /etc/hostname"}

        async def forced_read(s: CachedSession) -> None:
            await s.call("bash", cmd, effect=Effect.READ)

        async with anyio.create_task_group() as tg:
            for s in counted:
                tg.start_soon(forced_read, s)
        runs = await wss[0].exec("wc -l < /tmp/runs")
        assert runs.stdout.strip() == "1"


def _flip(store: Store, tmp_path: Path) -> None:
    if isinstance(store, MemoryStore):
        raw = store._raw()
        key = next(iter(raw))
        value = bytearray(raw[key])
        value[len(value) // 2] ^= 0xFF
        raw[key] = bytes(value)
    elif isinstance(store, SqliteStore):
        db = sqlite3.connect(store.path)
        (key, value) = db.execute("SELECT key, value FROM entries").fetchone()
        db.execute("UPDATE entries SET value = ? WHERE key = ?", (value[: len(value) - 7], key))  # truncated
        db.commit()
        db.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
async def test_a_corrupted_entry_is_a_miss(kind: str, tmp_path: Path, redis_server: RedisServer) -> None:
    store: Store
    if kind == "memory":
        store = MemoryStore()
    elif kind == "sqlite":
        store = SqliteStore(tmp_path / "c.db")
    else:
        store = RedisStore(redis_server.url, prefix=tmp_path.name.encode() + b":")
    async with ToolCache(store) as cache, workspaces(1) as (ws,):
        s = cache.session(ws)
        cmd = {"command": "ls -la /etc | head -3"}
        first = await s.call("bash", cmd)
        if isinstance(store, RedisStore):
            import redis

            client = redis.Redis.from_url(redis_server.url)
            (rkey,) = client.keys(store.prefix + b"*")
            value = bytearray(client.get(rkey))  # type: ignore[arg-type]
            value[-3] ^= 0x01
            client.set(rkey, bytes(value))
            client.close()
        else:
            _flip(store, tmp_path)
        second = await s.call("bash", cmd)
        third = await s.call("bash", cmd)
        assert sources(s) == ["executed", "executed", "cache"]
        assert first.stdout == second.stdout == third.stdout
        assert cache.metrics().corrupt == 1


async def test_nondeterministic_calls_are_not_cached_and_end_sharing() -> None:
    async with ToolCache() as cache, workspaces(2) as (ws1, ws2):
        a, b = cache.session(ws1), cache.session(ws2)
        await a.call("bash", {"command": "date +%N"})
        await a.call("bash", {"command": "date +%N"})
        assert sources(a) == ["uncacheable", "uncacheable"]
        for s in (a, b):
            await s.call("bash", {"command": "echo $RANDOM > r.txt"})
        assert a.state != b.state  # nobody can name the state after a nondeterministic write
        await a.call("read_file", {"path": "r.txt"})
        await b.call("read_file", {"path": "r.txt"})
        assert sources(b)[-1] == "executed"
        assert await a.call("read_file", {"path": "r.txt"}) == a.history[-1].result
        assert sources(a)[-1] == "cache"  # the same rollout at the same state still hits
        assert cache.metrics().by_effect["read"].uncacheable == 2


async def test_deterministic_tool_errors_are_cached() -> None:
    async with ToolCache() as cache, workspaces(1) as (ws,):
        s = cache.session(ws)
        for _ in range(2):
            with pytest.raises(FileNotFound):
                await s.call("read_file", {"path": "missing.txt"})
        assert cache.metrics().by_tool["read_file"].hits == 1
        with pytest.raises(ToolCallError):
            await s.call("nope", {})
        with pytest.raises(ToolCallError):
            await s.call_json("bash", "{not json")
        r = await s.call_json("bash", '{"command": "echo hi"}')
        assert r.stdout == "hi\n"


async def test_pure_calls_are_keyed_on_arguments_only() -> None:
    calls = 0

    async def add(ws: Workspace, args: dict[str, Any]) -> int:
        nonlocal calls
        calls += 1
        return int(args["a"]) + int(args["b"])

    tool = Tool(name="add", effect=Effect.PURE, handler=add, result_type=int)
    async with ToolCache() as cache, workspaces(1) as (ws,):
        s = cache.session(ws, [tool, *builtin_tools()])
        assert await s.call("add", {"a": 1, "b": 2}) == 3
        await s.call("write_file", {"path": "x", "content": "changes the state"})
        assert await s.call("add", {"b": 2, "a": 1}) == 3
        assert calls == 1


async def test_audit_reports_mismatches() -> None:
    n = 0

    async def drifting(ws: Workspace, args: dict[str, Any]) -> int:
        nonlocal n
        n += 1
        return n  # claims to be deterministic, is not

    liar = Tool(name="liar", effect=Effect.READ, handler=drifting, result_type=int)
    async with ToolCache(audit_fraction=1.0, audit_seed=1) as cache, workspaces(1) as (ws,):
        s = cache.session(ws, [liar, *builtin_tools()])
        await s.call("liar", {})
        await s.call("liar", {})
        await s.call("bash", {"command": "ls /"})
        await s.call("bash", {"command": "ls /"})
        m = cache.metrics()
        assert m.audits == 2 and m.audit_mismatches == 1
        assert m.mismatches[0].tool == "liar"
    async with ToolCache(audit_fraction=0.25, audit_seed=7) as cache, workspaces(1) as (ws,):
        s = cache.session(ws)
        for _ in range(41):
            await s.call("bash", {"command": "cat /etc/hostname"})
        m = cache.metrics()
        assert 3 <= m.audits <= 20 and m.audit_mismatches == 0


async def test_results_are_shared_through_redis(redis_server: RedisServer, tmp_path: Path) -> None:
    prefix = b"shared-" + tmp_path.name.encode() + b":"
    async with workspaces(2) as (ws1, ws2):
        async with ToolCache(RedisStore(redis_server.url, prefix=prefix)) as machine_a:
            await machine_a.session(ws1).call("bash", {"command": "ls /usr"})
        async with ToolCache(RedisStore(redis_server.url, prefix=prefix)) as machine_b:
            s = machine_b.session(ws2)
            await s.call("bash", {"command": "ls /usr"})
            assert sources(s) == ["cache"]


# ------------------------------------------------------------------------------------------ with a state provider


class BrokenStateProvider(ForkStateProvider):
    """Captures for real, fails every restore (a fault injected at the provider interface)."""

    async def restore(self, ws: Workspace, ref: SnapshotRef) -> Workspace:
        raise ForkError("restore is broken on purpose", workspace_id=ws.id)


def snapshots_on_disk() -> set[str]:
    """Snapshot directories (not their ``<id>.users`` reference lists, nor the layers' directory)."""
    base = snapshot_dir()
    entries = list(base.iterdir()) if base.exists() else []
    return {p.name for p in entries if not p.name.endswith(".users") and p != layers_dir()}


async def test_write_hits_restore_with_a_provider() -> None:
    provider = ForkStateProvider()
    before = snapshots_on_disk()
    async with ToolCache(provider=provider) as cache, workspaces(2) as (ws1, ws2):
        a = cache.session(ws1)
        await a.call("bash", {"command": "echo built > artifact && sleep 0.2"})
        async with cache.session(ws2) as b:
            await b.call("bash", {"command": "echo built > artifact && sleep 0.2"})
            assert sources(b) == ["restored"]
            assert b.workspace is not ws2  # continued in the restored workspace
            cat = {"command": "cat artifact"}
            assert await b.call("bash", cat) == await a.call("bash", cat)
            assert a.state == b.state
            restored = b.workspace
        assert restored.closed and not ws2.closed  # the session closed what it owned, not the caller's
        m = cache.metrics()
        assert m.restores == 1 and m.by_effect["write"].hits == 1 and m.captures == 1
        await a.aclose()
    assert len(provider) == 0 and snapshots_on_disk() == before  # closing the cache discarded its snapshots


async def test_concurrent_identical_writes_run_once_with_a_provider() -> None:
    async with ToolCache(provider=ForkStateProvider()) as cache, workspaces(4) as wss:
        sessions = [cache.session(ws) for ws in wss]
        cmd = {"command": "echo x >> ran && sleep 0.3"}
        async with anyio.create_task_group() as tg:
            for s in sessions:
                tg.start_soon(s.call, "bash", cmd)
        assert sorted(sources(s)[0] for s in sessions) == ["executed"] + ["restored"] * 3
        assert cache.metrics().by_effect["write"].shared == 3
        for s in sessions:
            assert (await s.call("read_file", {"path": "ran"})) == "x\n"
        for s in sessions:
            await s.aclose()
        assert cache.metrics().restores == 3


async def test_failed_restore_falls_back_to_executing() -> None:
    async with ToolCache(provider=BrokenStateProvider()) as cache, workspaces(2) as (ws1, ws2):
        a, b = cache.session(ws1), cache.session(ws2)
        for s in (a, b):
            await s.call("write_file", {"path": "f", "content": "v"})
        assert sources(b) == ["executed"] and b.workspace is ws2
        assert cache.metrics().restore_failures == 1
        assert await b.call("read_file", {"path": "f"}) == "v"


def test_state_tree_never_evicts_a_pinned_snapshot() -> None:
    tree = StateTree(snapshot_budget=100)
    root, s1, s2, s3 = b"r" * 16, b"1" * 16, b"2" * 16, b"3" * 16
    tree.pin(root)
    tree.pin(s1, root)
    assert tree.attach(s1, SnapshotRef("one", 60)) == []
    tree.pin(s2, s1)
    evicted = tree.attach(s2, SnapshotRef("two", 60))  # over budget, but s1 and s2 are both pinned
    assert evicted == [] and tree.snapshot_bytes == 120
    tree.unpin(s1)
    assert [ref.id for _, ref in tree.evict()] == ["one"]
    tree.pin(s3, s2)
    tree.unpin(s2)
    assert [ref.id for _, ref in tree.attach(s3, SnapshotRef("three", 60))] == ["two"]
    assert s1 in tree and s2 in tree  # ancestors of a live state stay in the tree (without snapshots)
    assert tree.refs(s3) == 1 and tree.snapshot(s3) == SnapshotRef("three", 60)
    assert [ref.id for _, ref in tree.drain()] == ["three"]
    tree.unpin(s3)
    tree.unpin(root)
    assert len(tree) == 0  # nothing held, nothing kept


async def test_redis_outage_mid_run_degrades_and_recovers(own_redis: RedisServer) -> None:
    from bunshin_async.cache import CacheWarning, LayeredStore

    redis = RedisStore(own_redis.url, retry_interval=0.05, socket_timeout=0.5)
    async with ToolCache(LayeredStore(MemoryStore(), redis)) as cache, workspaces(2) as (ws1, ws2):
        s = cache.session(ws1)
        await s.call("bash", {"command": "ls /"})
        own_redis.stop()
        with pytest.warns(CacheWarning) as caught:
            for i in range(5):
                await s.call("write_file", {"path": f"f{i}", "content": str(i)})
                assert await s.call("read_file", {"path": f"f{i}"}) == str(i)
                await s.call("bash", {"command": "ls /"})
        assert sum(issubclass(w.category, CacheWarning) for w in caught) == 1
        await anyio.to_thread.run_sync(own_redis.start)
        deadline = anyio.current_time() + 5
        while not await redis.ping():
            assert anyio.current_time() < deadline
            await anyio.sleep(0.05)
        # Another machine (its own memory layer, the same Redis) sees what was cached during the outage too.
        async with ToolCache(RedisStore(own_redis.url)) as other:
            t = other.session(ws2)
            await t.call("bash", {"command": "ls /"})
            for i in range(5):
                await t.call("write_file", {"path": f"f{i}", "content": str(i)})
                assert await t.call("read_file", {"path": f"f{i}"}) == str(i)
            assert sources(t).count("cache") == 6


def test_state_tree_releases_a_snapshot_no_open_session_can_reach() -> None:
    """With ``release_unreachable``: a snapshot stays while a session stands above it (it may move there) or a
    restore from it is under way, and goes as soon as neither holds; without, it stays until evicted by budget."""
    for release in (True, False):
        tree = StateTree(snapshot_budget=1 << 30, release_unreachable=release)
        root, s1, s2 = b"r" * 16, b"1" * 16, b"2" * 16
        tree.pin(root)  # two sessions at the base
        tree.pin(root)
        tree.pin(s1, root)  # the first writes and moves on
        tree.unpin(root)
        assert tree.attach(s1, SnapshotRef("one", 60)) == [] and tree.reachable(s1)  # the second may come
        tree.pin(s1, root)  # the second restores from it ...
        tree.restoring(s1, +1)
        tree.unpin(root)  # ... and leaves the base
        assert tree.evict() == []  # mid-restore
        tree.restoring(s1, -1)
        tree.unpin(s1)
        assert not tree.reachable(s1)
        assert [ref.id for _, ref in tree.evict()] == (["one"] if release else [])
        tree.pin(s2, s1)
        tree.unpin(s1)
        assert tree.attach(s2, SnapshotRef("two", 60)) == ([(s2, SnapshotRef("two", 60))] if release else [])


async def test_a_capture_is_released_once_every_sibling_has_it_and_skipped_when_none_can_use_it() -> None:
    provider = ForkStateProvider()
    # the release rule alone (``weigh_captures`` would skip a capture of the fast ``echo z``: test_capture_cost.py)
    cache = ToolCache(provider=provider, release_unreachable=True, weigh_captures=False)
    async with cache, workspaces(3) as wss:
        sessions = [cache.session(ws) for ws in wss]
        try:
            cmd = {"command": "echo x >> ran && sleep 0.3"}
            async with anyio.create_task_group() as tg:
                for s in sessions:
                    tg.start_soon(s.call, "bash", cmd)
            assert sorted(sources(s)[0] for s in sessions) == ["executed", "restored", "restored"]
            m = cache.metrics()
            assert m.captures == 1 and m.snapshots == 0 and m.snapshots_evicted == 1  # all three have it: released
            assert len(provider) == 0  # (its directory stays while the two restored copies map its images)
            await sessions[1].call("bash", {"command": "echo z > theirs"})  # captured: sessions[0] may follow
            await sessions[2].aclose()
            assert len(provider) == 1
            await sessions[0].call("bash", {"command": "echo y > mine && sleep 0.2"})  # nobody else can follow
            m = cache.metrics()
            assert m.captures == 2 and m.captures_skipped == 1  # not captured, ...
            assert len(provider) == 0 and m.snapshots_evicted == 2  # ... and sessions[1]'s state is out of reach
        finally:
            for s in sessions:
                await s.aclose()
