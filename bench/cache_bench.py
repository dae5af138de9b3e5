"""Tool prefix cache benchmark; prints one JSON object.

1. ``stores``: lookup (hit) and insert latency of each store, median and p90 in microseconds, over sealed records
   shaped like a shell result (about 1 KiB). Redis is a redis-server this script starts on a loopback port.
   ``session``: the whole hit path of ``CachedSession.call`` (classify, key, look up, verify, decode).
2. ``rollouts``: groups of 8 simulated sibling rollouts whose call sequences are built from real command sequences
   (``../shared/traces/swebench-gemini-3-pro.jsonl.gz``), shaped like the timed multi-rollout traces described
   in the README there: siblings share an exact prefix (pairwise mean ~3.9 calls) then diverge. Tool run times are
   drawn per command from the README's per-kind distributions (deterministic per command, so identical calls take
   identical time) and slept at ``--time-scale``; LLM think time between calls desynchronises the siblings.
   The fraction of calls and of tool time served from the cache is reported for cache off, cache on (read/pure
   hits), and, labelled separately, the write hits a fork ``StateProvider`` serves (simulated without its cost).
3. ``write_hits`` (root only): the cost of that on real workspaces with ``ForkStateProvider``, per kind of write:
   the call executed (and its state captured) by one rollout, then served to a sibling by restoring a fork.

Never fails because the machine is slow; targets are printed next to the numbers.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bunshin_async import ExecResult, Workspace  # noqa: E402
from bunshin_async._cache._records import Entry, seal  # noqa: E402  (the stores' record format, measured raw)
from bunshin_async.cache import (  # noqa: E402
    CachedSession,
    ForkStateProvider,
    MemoryStore,
    RedisStore,
    SnapshotRef,
    SqliteStore,
    Store,
    ToolCache,
)
from bunshin_async.tools import Tool, classify_command  # noqa: E402

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "swebench-gemini-3-pro.jsonl.gz"
TARGETS_US = {"memory": 20, "sqlite": 200, "redis": 1000}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(ns: list[int]) -> dict[str, float]:
    us = [x / 1000 for x in ns]
    return {"median_us": round(statistics.median(us), 2), "p90_us": round(pct(us, 0.9), 2), "n": len(us)}


# ---------------------------------------------------------------------------------------------- store latency


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(directory: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def sample_record(i: int) -> tuple[bytes, bytes]:
    key = random.Random(i).randbytes(16)
    result = ExecResult(0, f"line {i}\n" * 120, "", 0.25)
    import msgspec

    entry = Entry("bash", "read", msgspec.msgpack.encode(result), 0.25, time.time())
    return key, seal(key, entry)


async def bench_store(store: Store, n: int) -> dict[str, Any]:
    records = [sample_record(i) for i in range(n)]
    for key, value in records[:50]:  # warm up connections, threads, page cache
        await store.put(key, value)
        await store.get(key)
    puts, gets = [], []
    for key, value in records:
        t0 = time.perf_counter_ns()
        await store.put(key, value)
        puts.append(time.perf_counter_ns() - t0)
    order = list(range(n))
    random.Random(0).shuffle(order)
    for i in order:
        key = records[i][0]
        t0 = time.perf_counter_ns()
        v = await store.get(key)
        gets.append(time.perf_counter_ns() - t0)
        assert v is not None
    await store.aclose()
    return {"lookup": summary(gets), "insert": summary(puts), "record_bytes": len(records[0][1])}


class SimImage:
    digest = "sim-image"


class SimWorkspace:
    """Enough of a ``Workspace`` for a session whose tools do not touch it."""

    image = SimImage()
    workdir = "/testbed"
    env: dict[str, str] = {}
    max_output = 1 << 20
    closed = False
    id = "sim"


async def bench_session_hit(n: int) -> dict[str, Any]:
    async def handler(ws: Any, args: dict[str, Any]) -> ExecResult:
        return ExecResult(0, "x\n" * 500, "", 0.01)

    tool = Tool(
        name="bash",
        schema={"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        handler=handler,
        result_type=ExecResult,
        classify=lambda a: classify_command(a["command"]),
    )
    async with ToolCache(MemoryStore()) as cache:
        s = CachedSession(cache, SimWorkspace(), [tool])  # type: ignore[arg-type]
        cmds = [f"grep -rn 'def f{i}' src | head -20" for i in range(200)]
        for c in cmds:
            await s.call("bash", {"command": c})
        times = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            await s.call("bash", {"command": cmds[i % len(cmds)]})
            times.append(time.perf_counter_ns() - t0)
        assert cache.metrics().hits == n
    return summary(times)


async def bench_stores(n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["memory"] = await bench_store(MemoryStore(), n)
    with tempfile.TemporaryDirectory(prefix="bunshin-bench-") as d:
        out["sqlite"] = await bench_store(SqliteStore(Path(d) / "cache.db"), n)
        proc, port = start_redis(d)
        try:
            out["redis"] = await bench_store(RedisStore(f"redis://127.0.0.1:{port}/0"), n)
        finally:
            proc.terminate()
            proc.wait(10)
    for name, target in TARGETS_US.items():
        out[name]["lookup_target_median_us"] = target
        out[name]["lookup_meets_target"] = out[name]["lookup"]["median_us"] < target
    out["session_hit_memory"] = await bench_session_hit(n)
    return out


# ---------------------------------------------------------------------------------------------- rollouts

# Per-kind tool time (seconds): lognormal with the README's medians; sigmas chosen so the shares of tool time come
# out near the README's (installs ~37%, exec ~50%, reads ~0.3%).
KIND_TIME = {
    "install": (28.5, 0.5),
    "exec": (0.25, 2.5),
    "test": (1.2, 1.5),
    "read": (0.019, 1.0),
    "search": (0.019, 1.0),
    "edit": (0.03, 1.0),
    "fs_mutate": (0.03, 1.0),
    "submit": (0.1, 0.5),
}
LLM_TURN = (3.3, 0.9)  # median seconds, sigma


def nominal_seconds(task: str, command: str, kind: str) -> float:
    median, sigma = KIND_TIME.get(kind, (0.25, 1.0))
    rng = random.Random(f"{task}\0{command}")
    return median * math.exp(rng.gauss(0.0, sigma))


def load_tasks(limit: int, min_steps: int) -> list[tuple[str, list[tuple[str, str]]]]:
    tasks = []
    with gzip.open(TRACES, "rt") as f:
        for line in f:
            row = json.loads(line)
            steps = [
                (s["args"]["command"], s["kind"])
                for s in row["steps"]
                if s.get("kind") != "format_error" and isinstance(s.get("args", {}).get("command"), str)
            ]
            if len(steps) >= min_steps:
                tasks.append((row["task_id"], steps))
    random.Random(0).shuffle(tasks)
    return tasks[:limit]


def make_group(
    rng: random.Random, steps: list[tuple[str, str]], others: list[tuple[str, str]], size: int, p_diverge: float
) -> list[list[tuple[str, str]]]:
    """``size`` siblings: a geometric-length exact prefix of ``steps``, then a perturbed continuation."""
    group = []
    for _ in range(size):
        k = 1
        while k < len(steps) and rng.random() > p_diverge:
            k += 1
        seq = list(steps[:k])
        if k < len(steps):
            seq.append(rng.choice(others))  # the first divergent call
            for step in steps[k + 1 :]:
                seq.append(step if rng.random() < 0.5 else rng.choice(others))
        group.append(seq)
    return group


def shared_prefix(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x[0] != y[0]:
            break
        n += 1
    return n


class NoopProvider:
    """Pretends to fork: the simulated workspace has no state. Restore cost is not modeled."""

    async def capture(self, ws: Any) -> SnapshotRef:
        return SnapshotRef("sim", 0)

    async def restore(self, ws: Any, ref: SnapshotRef) -> Any:
        return ws

    async def discard(self, ref: SnapshotRef) -> None:
        return None


async def simulate(
    groups: list[tuple[str, list[list[tuple[str, str]]]]], mode: str, time_scale: float
) -> dict[str, Any]:
    """mode: ``off`` (no cache), ``on`` (no provider: read/pure hits) or ``fork`` (no-op provider: write hits)."""
    nominal: dict[tuple[str, str], float] = {}
    served_calls = 0
    served_seconds = 0.0
    unserved_calls = 0
    unserved_seconds = 0.0
    total_calls = 0
    total_seconds = 0.0
    by_effect: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    cache = ToolCache(MemoryStore(1 << 30), NoopProvider() if mode == "fork" else None)

    for task, rollouts in groups:

        async def handler(ws: Any, args: dict[str, Any], task: str = task) -> ExecResult:
            secs = nominal[(task, args["command"])]
            await anyio.sleep(secs * time_scale)
            return ExecResult(0, f"simulated output of {args['command'][:40]}", "", secs)

        tool = Tool(
            name="bash",
            schema={"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
            handler=handler,
            result_type=ExecResult,
            classify=lambda a: classify_command(a["command"]),
        )

        async def rollout(seq: list[tuple[str, str]], seed: int, task: str = task, tool: Tool = tool) -> None:
            nonlocal served_calls, served_seconds, total_calls, total_seconds, unserved_calls, unserved_seconds
            rng = random.Random(seed)
            session = CachedSession(cache, SimWorkspace(), [tool], salt=task)  # type: ignore[arg-type]
            for command, kind in seq:
                secs = nominal.setdefault((task, command), nominal_seconds(task, command, kind))
                await anyio.sleep(LLM_TURN[0] * math.exp(rng.gauss(0, LLM_TURN[1])) * time_scale)
                if mode == "off":
                    await handler(None, {"command": command})
                    effect, hit = classify_command(command).effect.value, False
                else:
                    rec = await session.call_ex("bash", {"command": command})
                    effect, hit = rec.effect.value, rec.hit
                    if rec.unserved_hit:
                        unserved_calls += 1
                        unserved_seconds += secs
                e = by_effect.setdefault(effect, {"calls": 0, "seconds": 0.0, "served_calls": 0, "served_seconds": 0.0})
                e["calls"] += 1
                e["seconds"] += secs
                total_calls += 1
                total_seconds += secs
                if hit:
                    served_calls += 1
                    served_seconds += secs
                    e["served_calls"] += 1
                    e["served_seconds"] += secs
            await session.aclose()

        async with anyio.create_task_group() as tg:
            for i, seq in enumerate(rollouts):
                tg.start_soon(rollout, seq, hash((task, i)) & 0xFFFF)

    m = cache.metrics()
    await cache.aclose()
    out: dict[str, Any] = {
        "calls": total_calls,
        "tool_seconds": round(total_seconds, 1),
        "served_call_fraction": round(served_calls / total_calls, 4),
        "served_tool_time_fraction": round(served_seconds / total_seconds, 4),
        "by_effect": {
            k: {
                "calls": int(v["calls"]),
                "tool_seconds": round(v["seconds"], 1),
                "served_call_fraction": round(v["served_calls"] / v["calls"], 4),
                "served_tool_time_fraction": round(v["served_seconds"] / v["seconds"], 4) if v["seconds"] else 0.0,
            }
            for k, v in sorted(by_effect.items())
        },
        "wall_seconds_scaled": round(time.perf_counter() - t0, 2),
    }
    if mode != "off":
        out["single_flight_shared"] = sum(s.shared for s in m.by_tool.values())
    if mode == "on":
        out["write_hits_found_not_served"] = {
            "calls": unserved_calls,
            "call_fraction": round(unserved_calls / total_calls, 4),
            "tool_time_fraction": round(unserved_seconds / total_seconds, 4),
            "note": "write calls found in the cache but executed because no StateProvider is set",
        }
    return out


async def bench_rollouts(n_groups: int, group_size: int, time_scale: float) -> dict[str, Any]:
    # Pairwise shared prefix = min of two geometric prefixes: P(diverge) p with 1/(1-(1-p)^2) = 3.9.
    p = 1 - math.sqrt(1 - 1 / 3.9)
    tasks = load_tasks(n_groups, min_steps=10)
    pool = [s for _, steps in load_tasks(500, 1) for s in steps]
    rng = random.Random(42)
    groups = [(task, make_group(rng, steps, pool, group_size, p)) for task, steps in tasks]
    prefixes = [shared_prefix(a, b) for _, g in groups for i, a in enumerate(g) for b in g[i + 1 :]]
    kinds: dict[str, int] = {}
    for _, g in groups:
        for seq in g:
            for _, kind in seq:
                kinds[kind] = kinds.get(kind, 0) + 1
    out: dict[str, Any] = {
        "groups": len(groups),
        "rollouts_per_group": group_size,
        "mean_pairwise_shared_prefix": round(statistics.mean(prefixes), 2),
        "median_pairwise_shared_prefix": statistics.median(prefixes),
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "time_scale": time_scale,
    }
    out["cache_off"] = await simulate(groups, "off", time_scale)
    out["cache_on_read_pure_hits"] = await simulate(groups, "on", time_scale)
    fork = await simulate(groups, "fork", time_scale)
    fork["note"] = (
        "what a fork StateProvider serves (write hits restored, concurrent identical writes run once); simulated "
        "with a no-op provider, restore cost not modeled here (see write_hits)"
    )
    out["would_serve_with_fork_provider"] = fork
    return out


WRITE_KINDS = {
    "echo": "echo {i} > f{i}",
    "sleep_0.5s": "sleep 0.5; echo {i} > f{i}",
    "python_100MiB": 'python3 -c \'import os, time; x = os.urandom(100 << 20); open("ready{i}", "w"); '
    "time.sleep(1e6)' >/dev/null 2>&1 & until [ -e ready{i} ]; do sleep 0.02; done",
}


async def bench_write_hits(n: int) -> dict[str, Any]:
    """Per kind: ``execute_s`` (the tool run), ``miss_s`` (run + capture, what the first rollout pays),
    ``hit_s`` (the restore a sibling pays instead of ``execute_s``), the snapshot size."""
    out: dict[str, Any] = {}
    for kind, template in WRITE_KINDS.items():
        execute, miss, hit, size = [], [], [], []
        provider = ForkStateProvider()
        async with ToolCache(provider=provider) as cache:
            for i in range(n):
                args = {"command": template.format(i=i)}
                async with Workspace() as ws, cache.session(ws, salt=f"{kind}{i}") as first:
                    t0 = time.perf_counter()
                    rec = await first.call_ex("bash", args)
                    miss.append(time.perf_counter() - t0)
                    execute.append(rec.duration)
                size.append(cache.metrics().snapshot_bytes / (i + 1))
                async with Workspace() as ws, cache.session(ws, salt=f"{kind}{i}") as sibling:
                    t0 = time.perf_counter()
                    rec = await sibling.call_ex("bash", args)
                    hit.append(time.perf_counter() - t0)
                    assert rec.source == "restored", rec.source
        out[kind] = {
            "execute_s": round(statistics.median(execute), 4),
            "miss_s": round(statistics.median(miss), 4),
            "hit_s": {"median": round(statistics.median(hit), 4), "p90": round(pct(hit, 0.9), 4)},
            "hit_over_execute": round(statistics.median(hit) / statistics.median(execute), 2),
            "snapshot_mib": round(statistics.median(size) / (1 << 20), 1),
        }
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=3000, help="records per store")
    ap.add_argument("--groups", type=int, default=40)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=2e-4, help="sleep this fraction of simulated seconds")
    ap.add_argument("--skip-rollouts", action="store_true")
    ap.add_argument("--write-hits", type=int, default=5, help="repeats per kind of write (0: skip; needs root)")
    args = ap.parse_args()
    result: dict[str, Any] = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    result["stores"] = await bench_stores(args.n)
    if not args.skip_rollouts and TRACES.exists():
        result["rollouts"] = await bench_rollouts(args.groups, args.group_size, args.time_scale)
    if args.write_hits and os.geteuid() == 0:
        result["write_hits"] = await bench_write_hits(args.write_hits)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    anyio.run(main)
