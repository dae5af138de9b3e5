"""Workspace benchmark: create-to-first-exec, exec and shell round-trips, idle PSS, 32 concurrent creations.

Prints one JSON object. Times are milliseconds (median, p90 over repeated runs in this one process).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import pss_kib, summary  # noqa: E402

from bunshin_async import Workspace  # noqa: E402


async def create_to_first_exec(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        ws = Workspace()
        await ws.start()
        await ws.exec(["true"])
        out.append(time.perf_counter() - t)
        await ws.aclose()
    return out


async def round_trips(n: int) -> tuple[list[float], list[float], list[float]]:
    async with Workspace() as ws:
        execs, shells, pings = [], [], []
        for _ in range(20):
            await ws.exec(["true"])
        for _ in range(n):
            t = time.perf_counter()
            await ws.exec(["true"])
            execs.append(time.perf_counter() - t)
        async with ws.shell() as sh:
            for _ in range(20):
                await sh.run("true")
            for _ in range(n):
                t = time.perf_counter()
                await sh.run("true")
                shells.append(time.perf_counter() - t)
        for _ in range(n):
            t = time.perf_counter()
            await ws.ping()
            pings.append(time.perf_counter() - t)
    return execs, shells, pings


async def idle_pss(count: int) -> dict[str, float]:
    """PSS of every process of ``count`` idle workspaces (pid 1 + agent), per workspace."""
    workspaces = [Workspace() for _ in range(count)]
    try:
        for ws in workspaces:
            await ws.start()
            await ws.exec(["true"])
        await anyio.sleep(0.5)
        pids = [pid for ws in workspaces if ws.cgroup for pid in ws.cgroup.pids()]
        total = pss_kib(pids)
        return {
            "workspaces": count,
            "total_pss_mib": round(total / 1024, 2),
            "per_workspace_mib": round(total / 1024 / count, 2),
        }
    finally:
        for ws in workspaces:
            await ws.aclose()


async def concurrent_creations(n: int) -> dict[str, object]:
    latencies: list[float] = []
    workspaces: list[Workspace] = []

    async def one() -> None:
        t = time.perf_counter()
        ws = Workspace()
        workspaces.append(ws)
        await ws.start()
        await ws.exec(["true"])
        latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
        wall = time.perf_counter() - t0
    finally:
        for ws in workspaces:
            await ws.aclose()
    return {"n": n, "wall_ms": round(wall * 1000, 1), "per_workspace": summary(latencies)}


async def main() -> None:
    reps = int(os.environ.get("BENCH_REPS", "30"))
    first = await create_to_first_exec(reps)
    execs, shells, pings = await round_trips(reps * 10)
    result = {
        "benchmark": "workspace",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "create_to_first_exec_ms": summary(first),
        "exec_true_round_trip_ms": summary(execs),
        "shell_round_trip_ms": summary(shells),
        "agent_ping_round_trip_ms": summary(pings),
        "idle_pss_1": await idle_pss(1),
        "idle_pss_16": await idle_pss(16),
        "concurrent_32": await concurrent_creations(32),
        "targets": {"create_to_first_exec_p50_ms": 50, "exec_round_trip_p50_ms": 2, "idle_pss_mib": 10},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    anyio.run(main)
