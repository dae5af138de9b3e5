"""Workspace benchmark: create-to-first-exec, exec and shell round-trips, idle PSS, 32 concurrent creations.

Prints one JSON object. Times are milliseconds (median, p90 over repeated runs in this one process), for the C agent
(`native/agent.c`). ``--security both`` and ``--disk both`` compare a setting on and off side by side instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import pss_kib, summary  # noqa: E402

from bunshin_async import Limits, Security, Workspace  # noqa: E402

Factory = Callable[[], Workspace]


async def create_to_first_exec(factories: dict[str, Factory], n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in factories}
    for _ in range(n):
        for kind, make in factories.items():  # interleaved: both see the same machine load
            t = time.perf_counter()
            ws = make()
            await ws.start()
            await ws.exec(["true"])
            out[kind].append(time.perf_counter() - t)
            await ws.aclose()
    return out


async def round_trips(make: Factory, n: int) -> tuple[list[float], list[float], list[float]]:
    async with make() as ws:
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


async def idle_pss(make: Factory, count: int) -> dict[str, float]:
    """PSS of every process of ``count`` idle workspaces (pid 1 + agent), per workspace."""
    workspaces = [make() for _ in range(count)]
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


async def concurrent_creations(make: Factory, n: int) -> dict[str, object]:
    latencies: list[float] = []
    workspaces: list[Workspace] = []

    async def one() -> None:
        t = time.perf_counter()
        ws = make()
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


async def _alternated(makers: dict[str, Factory], reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Create-to-first-exec and 10 exec round trips per workspace, for each maker in turn (order alternated per rep,
    so both see the same machine load)."""
    first: dict[str, list[float]] = {name: [] for name in makers}
    execs: dict[str, list[float]] = {name: [] for name in makers}
    for rep in range(reps):
        for name in list(makers) if rep % 2 == 0 else list(makers)[::-1]:
            t = time.perf_counter()
            ws = makers[name]()
            await ws.start()
            await ws.exec(["true"])
            first[name].append(time.perf_counter() - t)
            for _ in range(10):
                t = time.perf_counter()
                await ws.exec(["true"])
                execs[name].append(time.perf_counter() - t)
            await ws.aclose()
    return first, execs


async def security_compare(reps: int) -> None:
    """The boundary's cost (``--security both``): the same measurements with the boundary on (the default) and with
    ``Security.off()``, alternated in one run."""
    configs = {"on": Security(), "off": Security.off()}
    first, execs = await _alternated({name: partial(Workspace, security=sec) for name, sec in configs.items()}, reps)
    pss: dict[str, float] = {}
    for name, sec in configs.items():
        workspaces = [Workspace(security=sec) for _ in range(8)]
        try:
            for ws in workspaces:
                await ws.start()
                await ws.exec(["true"])
            await anyio.sleep(0.5)
            pids = [pid for ws in workspaces if ws.cgroup for pid in ws.cgroup.pids()]
            pss[name] = round(pss_kib(pids) / 1024 / len(workspaces), 2)
        finally:
            for ws in workspaces:
                await ws.aclose()
    out: dict[str, object] = {"benchmark": "workspace-security", "date": time.strftime("%Y-%m-%d"), "reps": reps}
    for name in configs:
        out[name] = {
            "create_to_first_exec_ms": summary(first[name]),
            "exec_true_round_trip_ms": summary(execs[name]),
            "idle_pss_per_workspace_mib_8": pss[name],
        }
    med = {name: statistics.median(first[name]) for name in configs}
    out["create_to_first_exec_on_over_off"] = round(med["on"] / med["off"], 3)
    ex = {name: statistics.median(execs[name]) for name in configs}
    out["exec_round_trip_on_over_off"] = round(ex["on"] / ex["off"], 3)
    print(json.dumps(out, indent=2))


async def disk_compare(reps: int) -> None:
    """The default disk bound's cost (``--disk both``): create-to-first-exec and an exec round trip with the bound
    on (``Limits()``: the upper dir on a 1 GiB tmpfs) and off (``Limits(disk=None)``), alternated in one run."""
    configs = {"on": Limits(), "off": Limits(disk=None)}
    first, execs = await _alternated({name: partial(Workspace, limits=lim) for name, lim in configs.items()}, reps)
    out: dict[str, object] = {"benchmark": "workspace-disk", "date": time.strftime("%Y-%m-%d"), "reps": reps}
    for name in configs:
        out[name] = {"create_to_first_exec_ms": summary(first[name]), "exec_true_round_trip_ms": summary(execs[name])}
    out["create_to_first_exec_on_over_off"] = round(statistics.median(first["on"]) / statistics.median(first["off"]), 3)
    out["exec_round_trip_on_over_off"] = round(statistics.median(execs["on"]) / statistics.median(execs["off"]), 3)
    print(json.dumps(out, indent=2))


async def measure(make: Factory, reps: int, first: list[float]) -> dict[str, object]:
    execs, shells, pings = await round_trips(make, reps * 10)
    return {
        "create_to_first_exec_ms": summary(first),
        "exec_true_round_trip_ms": summary(execs),
        "shell_round_trip_ms": summary(shells),
        "agent_ping_round_trip_ms": summary(pings),
        "idle_pss_1": await idle_pss(make, 1),
        "idle_pss_16": await idle_pss(make, 16),
        "concurrent_32": await concurrent_creations(make, 32),
    }


async def main() -> None:
    reps = int(os.environ.get("BENCH_REPS", "30"))
    factories: dict[str, Factory] = {"c": Workspace}
    firsts = await create_to_first_exec(factories, reps)
    agents = {kind: await measure(make, reps, firsts[kind]) for kind, make in factories.items()}
    result: dict[str, object] = {
        "benchmark": "workspace",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "agents": agents,
        "targets": {
            "create_to_first_exec_p50_ms": 20,
            "exec_round_trip_p50_ms": 0.5,
            "idle_pss_16_per_workspace_mib": 2,
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--security", choices=("on", "both"), default="on", help="both: the boundary on vs off only")
    ap.add_argument("--disk", choices=("on", "both"), default="on", help="both: the default disk bound on vs off only")
    args = ap.parse_args()
    if args.disk == "both":
        anyio.run(disk_compare, int(os.environ.get("BENCH_REPS", "30")))
    elif args.security == "both":
        anyio.run(security_compare, int(os.environ.get("BENCH_REPS", "30")))
    else:
        anyio.run(main)
