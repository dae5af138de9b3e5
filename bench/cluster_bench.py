"""Snapshots that move and groups over a Ray cluster (JSON on stdout).

1. Moving a workspace holding ``--mib`` MiB in a process's memory (default 200) from one node to another: the
   snapshot's export and import measured apart (in this process, frames held in memory) and the host-to-host fetch
   through Ray (export, transfer and import pipelined), each with its bandwidth, against re-running the set-up
   (a fresh workspace building the same state) and restoring the moved snapshot.
2. ``--groups`` groups of ``--n`` rollouts (each forks the set-up's snapshot, asks its in-memory guest, holds for
   ``--hold`` s as an agent's LLM time would, answers), run at once on 1 node and on 2 nodes (``--limit`` workspaces
   each): group latency, and peak memory per node (the workspaces' cgroup memory plus the snapshot store's bytes,
   sampled every 0.25 s).

Each node is a raylet of a ``ray.cluster_utils.Cluster`` on this machine with a Bunshin home, workspaces dir,
snapshot store and cgroup parent of its own (the test harness's ``Home``), so nothing moves through a shared
filesystem; "bandwidth" between two nodes on one machine is loopback through Ray's object store.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._stats import summary  # noqa: E402
from bunshin_async import Workspace  # noqa: E402
from bunshin_async.integrations.ray import ClusterGroupRollout, HostConfig, RayCluster  # noqa: E402
from bunshin_async.rollout import Task  # noqa: E402
from bunshin_async.transfer import export_snapshot, import_snapshot  # noqa: E402
from tests.ray.conftest import RayEnv  # noqa: E402
from tests.ray.test_cluster import DigestAgent, ask  # noqa: E402

GUEST = (ROOT / "tests" / "transfer" / "memory_guest.py").read_bytes()


async def _ready(ws: Any) -> None:
    with anyio.fail_after(300):
        while (await ws.exec("test -e /workspace/ready")).exit_code:  # noqa: ASYNC110 - polls the workspace
            await anyio.sleep(0.05)


async def _setup(ws: Any, mib: int) -> None:
    await ws.write_file("/workspace/memory_guest.py", GUEST)
    await ws.spawn(["python3", "/workspace/memory_guest.py", str(mib)])
    await _ready(ws)


async def _feed(frames: list[bytes]) -> Any:
    for f in frames:
        yield f


async def moving(env: RayEnv, mib: int, repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {"mib": mib}
    # Export and import apart, in this process: host a's store -> frames in memory -> host b's store.
    exp, imp, sizes = [], [], []
    for _ in range(repeat):
        with env.homes[0].active():
            async with Workspace() as ws:
                await _setup(ws, mib)
                async with await ws.snapshot() as snap:
                    t0 = time.monotonic()
                    frames = [f async for f in export_snapshot(snap)]
                    exp.append(time.monotonic() - t0)
        sizes.append(sum(len(f) for f in frames))

        with env.homes[1].active():
            t0 = time.monotonic()
            snap2, _ = await import_snapshot(_feed(frames))
            imp.append(time.monotonic() - t0)
            await snap2.aclose()
        del frames
    size = statistics.median(sizes)
    out["stream_mib"] = round(size / (1 << 20), 1)
    out["export_ms"] = summary(exp)
    out["import_ms"] = summary(imp)
    out["export_mib_s"] = round(size / (1 << 20) / statistics.median(exp), 1)
    out["import_mib_s"] = round(size / (1 << 20) / statistics.median(imp), 1)

    cluster = await RayCluster.start(env.configs(), names=env.names())
    try:
        async with cluster:
            n0, n1 = cluster.host("n0"), cluster.host("n1")
            setup_s, dump_s, fetch_s, restore_s, bws = [], [], [], [], []
            for _ in range(repeat):
                t0 = time.monotonic()
                ws = await cluster.workspace(n0)
                await _setup(ws, mib)
                setup_s.append(time.monotonic() - t0)
                digest = await ask(ws)
                t0 = time.monotonic()
                snap = await ws.snapshot()
                dump_s.append(time.monotonic() - t0)
                await ws.aclose()
                t0 = time.monotonic()
                moved, stats = await cluster.fetch(snap, n1)
                fetch_s.append(time.monotonic() - t0)
                assert stats is not None
                bws.append(stats.bandwidth / (1 << 20))
                t0 = time.monotonic()
                (copy,) = await moved.from_snapshot(1)
                restore_s.append(time.monotonic() - t0)
                assert copy.fork_mode == "criu-cow" and (await ask(copy))[0] == digest[0]
                await copy.aclose()
                await moved.aclose()
                await snap.aclose()
            out["setup_ms"] = summary(setup_s)
            out["snapshot_ms"] = summary(dump_s)
            out["fetch_ms"] = summary(fetch_s)
            out["fetch_mib_s"] = round(statistics.median(bws), 1)
            out["restore_moved_ms"] = summary(restore_s)
            moved_total = statistics.median(dump_s) + statistics.median(fetch_s) + statistics.median(restore_s)
            out["move_total_ms"] = round(moved_total * 1000, 1)
            out["move_vs_setup"] = round(moved_total / statistics.median(setup_s), 3)
    finally:
        await _stop_hosts(cluster)
    return out


async def _stop_hosts(cluster: RayCluster) -> None:
    import ray

    for h in cluster.hosts:
        try:
            left = await h.raw("shutdown")
            assert not left, left
        finally:
            ray.kill(h.actor)
    await anyio.sleep(1)  # the names are free once Ray has seen the actors die


async def groups(env: RayEnv, nodes: int, k: int, n: int, limit: int, mib: int, hold: float) -> dict[str, Any]:
    configs = dict(list(env.configs().items())[:nodes])
    configs = {
        node: HostConfig(max_workspaces=limit, lease_seconds=c.lease_seconds, env=c.env) for node, c in configs.items()
    }
    task = Task(
        task_id="mem",
        prompt="",
        files={"memory_guest.py": GUEST},
        background=[f"python3 /workspace/memory_guest.py {mib}"],
        ready=["test -e /workspace/ready"],
        reward_command="test -s /workspace/digest.txt",
    )
    for _ in range(30):
        try:
            cluster = await RayCluster.start(configs, names=env.names())
            break
        except ValueError:
            await anyio.sleep(1)
    peaks: dict[str, int] = {h.name: 0 for h in cluster.hosts}
    latencies: list[float] = []
    placements: dict[str, int] = {}
    failed = 0
    try:
        async with cluster:

            async def sample() -> None:
                while True:
                    for info in await cluster.infos():
                        if info is not None:
                            peaks[info.name] = max(peaks[info.name], info.memory_bytes)
                    await anyio.sleep(0.25)

            async def group() -> None:
                nonlocal failed
                t0 = time.monotonic()
                async with ClusterGroupRollout(cluster, task, n, DigestAgent(hold=hold), rollout_seconds=hold) as g:
                    async for r in g:
                        failed += r.status != "finished"
                        key = f"{r.node}:{r.placement}"
                        placements[key] = placements.get(key, 0) + 1
                latencies.append(time.monotonic() - t0)

            t0 = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(sample)
                async with anyio.create_task_group() as groups_tg:
                    for _ in range(k):
                        groups_tg.start_soon(group)
                tg.cancel_scope.cancel()
            wall = time.monotonic() - t0
    finally:
        await _stop_hosts(cluster)
    return {
        "nodes": nodes,
        "group_latency_s": summary(latencies, scale=1.0),
        "all_groups_s": round(wall, 2),
        "peak_mib_per_node": {k: round(v / (1 << 20), 1) for k, v in peaks.items()},
        "placements": placements,
        "failed": failed,
    }


async def main(args: argparse.Namespace) -> None:
    env = RayEnv()
    try:
        out: dict[str, Any] = {
            "machine": "shared 2-core / 24 GiB VM; both nodes are raylets on it",
            "moving": await moving(env, args.mib, args.repeat),
        }
        one = await groups(env, 1, args.groups, args.n, args.limit, args.group_mib, args.hold)
        two = await groups(env, 2, args.groups, args.n, args.limit, args.group_mib, args.hold)
        out["groups"] = {"one_node": one, "two_nodes": two}
        out["groups"]["latency_ratio_2_vs_1"] = round(
            two["group_latency_s"]["median"] / one["group_latency_s"]["median"], 3
        )
        print(json.dumps(out, indent=1))
    finally:
        env.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=200, help="MiB in the moved workspace's memory")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--limit", type=int, default=8, help="workspaces per node")
    ap.add_argument("--group-mib", type=int, default=32, help="MiB in each group's set-up guest")
    ap.add_argument("--hold", type=float, default=2.0, help="seconds each rollout holds (its LLM time)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    a = ap.parse_args()
    if a.quick:
        a.mib, a.repeat, a.groups, a.n, a.group_mib, a.hold = 32, 1, 2, 4, 8, 0.5
    anyio.run(main, a)
