"""Bunshin over a real two-node Ray cluster: handles proxying the Workspace API with its errors, snapshots moving
between nodes, a group of 8 placed over two nodes of 4 slots each, a cache write hit served on the other node, a
corrupted transfer, an owner that stops renewing its lease, and a host actor killed mid-group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import ray

from bunshin_async import (
    FileNotFound,
    HostCallError,
    HostError,
    PathOutsideWorkspace,
    TransferError,
    WorkspaceClosed,
)
from bunshin_async.integrations._ray import _remote
from bunshin_async.integrations.ray import ClusterGroupRollout, HostRef, RayCluster, RemoteWorkspace
from bunshin_async.rollout import RolloutContext, Step, Task, Trajectory
from tests.ray.conftest import LEASE, LIMIT, RayEnv, kill_host, restart_host

GUEST = (Path(__file__).parents[1] / "transfer" / "memory_guest.py").read_bytes()
MIB = 16


async def ask(ws: RemoteWorkspace) -> tuple[str, int]:
    await ws.write_file("/workspace/ask", "1")
    with anyio.fail_after(30):
        while True:
            r = await ws.exec("cat /workspace/answer 2>/dev/null && rm /workspace/answer")
            if r.exit_code == 0 and r.stdout:
                digest, n = r.stdout.split()
                return digest, int(n)
            await anyio.sleep(0.02)


def task(setup_sleep: float = 0.0) -> Task:
    return Task(
        task_id="mem",
        prompt="answer with the digest",
        files={"memory_guest.py": GUEST},
        setup=[f"sleep {setup_sleep}", "echo prepared > prepared.txt"],
        background=[f"python3 /workspace/memory_guest.py {MIB}"],
        ready=["test -e /workspace/ready"],
        reward_command="test -s /workspace/digest.txt",
    )


class DigestAgent:
    """Asks the set-up's in-memory guest (its memory came with the fork) and records the answer. With ``watch``
    (the cluster, the group's size) the rollouts wait for each other once they have asked, and the last to ask
    records the snapshots each host then holds (``snapshots_held``: every copy exists by then)."""

    def __init__(
        self, hold: float = 0.0, watch: tuple[RayCluster, int] | None = None, release: anyio.Event | None = None
    ) -> None:
        self.hold = hold
        self.release = release  # with it, the rollouts hold until it is set instead
        self.watch = watch
        self.answers: dict[int, tuple[str, int]] = {}
        self.nodes: dict[int, str] = {}
        self.snapshots_held: dict[str, int] | None = None
        self._all_asked = anyio.Event()

    async def run(self, ctx: RolloutContext) -> Trajectory:
        ws: Any = ctx.ws
        self.nodes[ctx.rollout] = ws.node
        self.answers[ctx.rollout] = await ask(ws)
        if self.watch is not None:
            cluster, n = self.watch
            if len(self.answers) == n:
                self.snapshots_held = {i.name: i.snapshots for i in await cluster.infos() if i is not None}
                self._all_asked.set()
            with anyio.fail_after(60):
                await self._all_asked.wait()
        if self.release is not None:
            with anyio.fail_after(120):
                await self.release.wait()
        await anyio.sleep(self.hold)
        await ws.exec(f"echo {self.answers[ctx.rollout][0]} > /workspace/digest.txt")
        return Trajectory(task_id=ctx.task.task_id, rollout=ctx.rollout, steps=[Step(tool="bash", exit_code=0)])


async def test_handles_proxy_the_workspace_api_with_its_errors(cluster: RayCluster) -> None:
    n0, n1 = cluster.host("n0"), cluster.host("n1")
    async with await cluster.workspace(n1) as ws:
        assert ws.node == "n1" and ws.fork_mode == "fresh"
        await ws.write_file("/workspace/a.txt", "hello\n")
        assert await ws.read_text("/workspace/a.txt") == "hello\n"
        assert [e.name for e in await ws.list_dir("/workspace")] == ["a.txt"]
        r = await ws.exec("cat a.txt; exit 3")
        assert (r.exit_code, r.stdout) == (3, "hello\n")
        with pytest.raises(FileNotFound) as nf:
            await ws.read_file("/workspace/missing")
        assert nf.value.path == "/workspace/missing"
        with pytest.raises(PathOutsideWorkspace):
            await ws.read_file("../../etc/shadow")
        await ws.write_file("/workspace/memory_guest.py", GUEST)
        await ws.spawn(["python3", "/workspace/memory_guest.py", str(MIB)])
        with anyio.fail_after(60):
            while (await ws.exec("test -e /workspace/ready")).exit_code:
                await anyio.sleep(0.05)
        digest, _ = await ask(ws)
        copies = await ws.fork(2)
        assert [c.fork_mode for c in copies] == ["criu-cow", "criu-cow"]
        assert [c.node for c in copies] == ["n1", "n1"]
        for c in copies:
            assert await ask(c) == (digest, 2)
            await c.aclose()
        async with await ws.snapshot() as snap:
            moved, stats = await cluster.fetch(snap, n0)
            assert stats is not None and stats.bytes > MIB << 20
            async with moved:
                (there,) = await moved.from_snapshot(1)
                async with there:
                    assert (there.node, there.fork_mode) == ("n0", "criu-cow")
                    assert await ask(there) == (digest, 2)  # ws's memory as of its snapshot
    with pytest.raises(WorkspaceClosed):
        await ws.exec("true")
    infos = await cluster.infos()
    assert all(i is not None and i.workspaces == 0 and i.in_use == 0 for i in infos)


async def test_group_of_8_over_2_nodes_of_4(cluster: RayCluster) -> None:
    agent = DigestAgent(hold=0.5)
    async with ClusterGroupRollout(cluster, task(setup_sleep=3), 8, agent, rollout_seconds=30) as group:
        results = [r async for r in group]
    assert len(results) == 8
    assert all(r.status == "finished" and r.reward == 1.0 for r in results), [r.reason for r in results]
    assert all(r.fork_mode == "criu-cow" for r in results)
    by_node: dict[str, list[str]] = {}
    for r in results:
        by_node.setdefault(r.node, []).append(r.placement)
    assert sorted(len(v) for v in by_node.values()) == [LIMIT, LIMIT]
    assert group.base_host is not None and by_node[group.base_host] == ["base"] * LIMIT
    other = next(n for n in by_node if n != group.base_host)
    assert set(by_node[other]) == {"shipped"}  # 3 s of set-up against a few MiB over loopback
    assert len(group.transfers) == 1  # the snapshot crossed once
    for r in results:
        assert r.estimates[f"{r.node}:{r.placement}"] == min(r.estimates.values())
    digests = {d for d, _ in agent.answers.values()}
    assert len(digests) == 1 and {n for _, n in agent.answers.values()} == {1}  # every copy's first question
    assert {agent.nodes[r.rollout] for r in results} == {"n0", "n1"}


async def test_a_slow_link_makes_the_other_node_run_the_set_up_again(cluster: RayCluster) -> None:
    agent = DigestAgent(watch=(cluster, 8))
    slow = {h.name: 1000.0 for h in cluster.hosts}  # 1 kB/s: shipping would take hours
    async with ClusterGroupRollout(cluster, task(), 8, agent, rollout_seconds=60, bandwidth=slow) as group:
        results = [r async for r in group]
    assert all(r.status == "finished" and r.reward == 1.0 for r in results), [r.reason for r in results]
    other = [r for r in results if r.node != group.base_host]
    assert len(other) == LIMIT and {r.placement for r in other} == {"re-setup"} and not group.transfers
    assert all(r.fork_mode == "criu-cow" for r in results)
    assert len({d for d, _ in agent.answers.values()}) == 1  # the same seeded state, built twice
    # once every rollout had its copy, neither the base snapshot nor the one set up again was held any more (the
    # copies map what they need): not for the rest of the group's run
    assert agent.snapshots_held == {h.name: 0 for h in cluster.hosts}


async def test_cache_write_hit_served_on_the_other_node(cluster: RayCluster) -> None:
    n0, n1 = cluster.host("n0"), cluster.host("n1")
    call = {"command": "python3 -c \"open('/workspace/made.txt','w').write('x' * 1000)\" && sleep 0.3"}
    async with await cluster.workspace(n0) as a, await cluster.workspace(n1) as b:
        source, _ = await a.cache_call("bash", call)
        assert source == "executed"
        source, result = await b.cache_call("bash", call)
        assert source == "restored", str((await n0.raw("cache_metrics"), await n1.raw("cache_metrics")))
        assert (await b.exec("wc -c < /workspace/made.txt")).stdout.strip() == "1000"
        assert b.node == "n1"
    metrics = await n1.raw("cache_metrics")
    assert metrics["restores"] == 1 and metrics["restore_failures"] == 0


@ray.remote(num_cpus=0)
class CorruptingSource:
    """Stands between a host and the snapshot it exports, flipping one bit of one frame on the way."""

    def __init__(self, host: Any, frame: int) -> None:
        self.host, self.frame = host, frame

    async def export(self, snap_id: str) -> Any:
        i = 0
        async for ref in self.host.export.options(num_returns="streaming").remote(snap_id):
            data = await ref
            if i == self.frame:
                data = bytearray(data)
                data[len(data) // 2] ^= 0x10
                data = bytes(data)
            i += 1
            yield data


async def test_corrupted_transfer_is_refused_and_leaves_nothing(cluster: RayCluster) -> None:
    n0, n1 = cluster.host("n0"), cluster.host("n1")
    async with await cluster.workspace(n0) as ws:
        await ws.write_file("/workspace/big.bin", b"\x01" * (6 << 20))
        async with await ws.snapshot() as snap:
            before = await n1.raw("leftovers")
            bad = CorruptingSource.remote(n0.actor, 2)
            with pytest.raises(TransferError, match="sha256"):
                await n1.call("fetch", bad, "n0", snap.id, cluster.owner)
            assert await n1.raw("leftovers") == before == []
            ray.kill(bad)


@ray.remote(num_cpus=0, max_restarts=0)
class DyingSource:
    """Passes ``frames`` frames of a host's export on, then dies (its process exits) mid-transfer."""

    def __init__(self, host: Any, frames: int) -> None:
        self.host, self.frames = host, frames

    async def export(self, snap_id: str) -> Any:
        i = 0
        async for ref in self.host.export.options(num_returns="streaming").remote(snap_id):
            if i == self.frames:
                import os

                os._exit(1)
            i += 1
            yield await ref


async def test_an_error_inside_a_live_host_fails_the_call_not_the_host(cluster: RayCluster) -> None:
    """A host method that raises something other than a ``BunshinError`` (here a real TypeError: an argument the
    workspace method does not take; an unhashable owner) is that call's ``HostCallError``, never the ``HostError``
    that says the host and its workspaces are gone; the workspace goes on serving."""
    n1 = cluster.host("n1")
    async with await cluster.workspace(n1) as ws:
        await ws.write_file("/workspace/kept.txt", "kept")
        with pytest.raises(HostCallError, match="TypeError in host n1") as in_reply:  # caught by the host's _run
            await ws._proxy("exec", "true", no_such_argument=1)
        assert not isinstance(in_reply.value, HostError) and in_reply.value.error == "TypeError"
        with pytest.raises(HostCallError, match="TypeError in host n1") as raised:  # out of the method, through Ray
            await n1.raw("renew", ["an", "unhashable", "owner"])
        assert raised.value.host == "n1" and raised.value.error == "TypeError"
        assert await ws.read_text("/workspace/kept.txt") == "kept"
        assert (await ws.exec("echo alive")).stdout == "alive\n"
        assert (await n1.info()).workspaces == 1


async def test_a_call_cancelled_after_the_host_made_its_result_releases_it(
    cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create, snapshot, fork or fetch cancelled after the host made what it asked for and before the reply came
    (injected: the caller's wait for the reply is cancelled once the reply is there) leaves nothing held: what the
    host made is released by the cancelled caller, not kept under the owner until the cluster closes."""
    real = _remote._reply
    scope: anyio.CancelScope | None = None

    async def reply(ref: Any) -> Any:
        value = await real(ref)  # the host finished
        if scope is not None and not scope.cancel_called:
            scope.cancel()
            await anyio.sleep_forever()  # the caller is cancelled here, its reply not taken
        return value

    monkeypatch.setattr(_remote, "_reply", reply)
    n0, n1 = cluster.host("n0"), cluster.host("n1")

    async def cancelled(make: Any) -> None:
        nonlocal scope
        with anyio.CancelScope() as scope:
            await make()
        assert scope.cancelled_caught
        scope = None

    async with await cluster.workspace(n1) as ws:
        await ws.write_file("/workspace/a.txt", "a")
        await cancelled(lambda: cluster.workspace(n1))
        await cancelled(ws.snapshot)
        await cancelled(lambda: ws.fork(2))
        info = await n1.info()
        assert (info.workspaces, info.in_use, info.snapshots) == (1, 1, 0), info
        async with await ws.snapshot() as snap:
            await cancelled(lambda: cluster.fetch(snap, n0))
            await cancelled(lambda: snap.from_snapshot(1))
            info, there = await n1.info(), await n0.info()
            assert (info.workspaces, info.in_use, info.snapshots, there.snapshots) == (1, 1, 1, 0), (info, there)
        assert (await ws.exec("cat a.txt")).stdout == "a"


async def test_a_transfer_cut_by_a_dying_source_leaves_nothing(cluster: RayCluster) -> None:
    n0, n1 = cluster.host("n0"), cluster.host("n1")
    async with await cluster.workspace(n0) as ws:
        await ws.write_file("/workspace/big.bin", b"\x02" * (12 << 20))
        async with await ws.snapshot() as snap:
            dying = DyingSource.remote(n0.actor, 2)
            with pytest.raises(HostError, match="n0"):
                await n1.call("fetch", dying, "n0", snap.id, cluster.owner)
            assert await n1.raw("leftovers") == []
            moved, _ = await cluster.fetch(snap, n1)  # the real source still serves it
            await moved.aclose()


async def test_an_owner_that_stops_renewing_is_freed(cluster: RayCluster) -> None:
    n1 = cluster.host("n1")
    dead = RayCluster(cluster.hosts, lease_seconds=LEASE)  # never entered: its lease thread renews nothing

    async def renewing() -> None:  # what its lease thread would do while the driver lives (a slow call outlived
        while True:  # the 3 s lease on a loaded machine)
            await n1.raw("renew", dead.owner)
            await anyio.sleep(LEASE / 3)

    async with anyio.create_task_group() as tg:
        tg.start_soon(renewing)
        ws = await dead.workspace(n1)
        assert (await ws.exec("echo hi")).stdout == "hi\n"
        tg.cancel_scope.cancel()  # the driver dies: no renewal from here on
    with anyio.fail_after(60):  # a hang guard (lease, reaper and close take ~4 s; more on a loaded machine)
        while (await n1.info()).workspaces:
            await anyio.sleep(0.2)
    with pytest.raises(WorkspaceClosed):
        await ws.exec("true")


async def test_a_killed_driver_leaks_nothing(ray_env: RayEnv, cluster: RayCluster) -> None:
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("driver.py")), ray_env.cluster.address, "n1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ws_id = (await anyio.to_thread.run_sync(proc.stdout.readline)).decode().strip()
        assert ws_id, "the second driver did not start its workspace"
        n1 = cluster.host("n1")
        await anyio.sleep(LEASE * 2)  # renewed while the driver lives
        assert (await n1.info()).workspaces == 1
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    with anyio.fail_after(60):  # a hang guard, as above
        while (await n1.info()).workspaces:
            await anyio.sleep(0.2)


async def test_a_host_killed_mid_group_fails_only_its_rollouts(ray_env: RayEnv, hosts: RayCluster) -> None:
    agent = DigestAgent(release=anyio.Event())
    results = []
    victim: HostRef | None = None
    try:
        async with RayCluster(hosts.hosts, lease_seconds=LEASE) as cluster:
            async with ClusterGroupRollout(cluster, task(setup_sleep=2), 8, agent, rollout_seconds=30) as group:

                async def kill_when_all_started() -> None:
                    nonlocal victim
                    with anyio.fail_after(120):
                        while len(agent.answers) < 8:
                            await anyio.sleep(0.05)
                    victim = next(h for h in cluster.hosts if h.name != group.base_host)
                    await kill_host(victim)  # the rollouts go on once the host answers no more (a fixed hold raced)
                    assert agent.release is not None
                    agent.release.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(kill_when_all_started)
                    async for r in group:
                        results.append(r)
        assert victim is not None and len(results) == 8
        dead = [r for r in results if r.node == victim.name]
        alive = [r for r in results if r.node != victim.name]
        assert len(dead) == len(alive) == LIMIT
        assert all(r.status == "finished" and r.reward == 1.0 for r in alive)
        assert all(r.status == "failed" and r.loss_mask == 0.0 for r in dead)
        assert all("HostError" in (r.reason or "") and victim.name in (r.reason or "") for r in dead), dead[0].reason
    finally:
        if victim is not None:  # also when the test failed: the module's later tests need both hosts
            await restart_host(hosts, victim.name, ray_env.configs()[victim.node_id])


async def test_an_export_abandoned_mid_stream_leaves_nothing(cluster: RayCluster) -> None:
    """A fetching side that stops reading after one frame (a host that failed its import early, a driver that went
    away): the exporting host's stream ends, and its snapshot, layers and tar go with the snapshot's close."""
    n0 = cluster.host("n0")
    async with await cluster.workspace(n0) as ws:
        r = await ws.exec("head -c 40M /dev/urandom > /workspace/big.bin")  # far more frames than are in flight
        assert r.exit_code == 0
        async with await ws.snapshot() as snap:
            frames = _remote.pull(n0.actor, "n0", snap.id)
            await frames.__anext__()
            await frames.aclose()
    # the autouse leak check: nothing of the export is left on n0
