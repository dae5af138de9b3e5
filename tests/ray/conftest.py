"""A real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and a second raylet, each
node with its own Bunshin home, workspaces dir, snapshot store and cgroup parent, so nothing is shared through
the filesystem) and a real redis-server. Ray is kept small: one CPU per node, no dashboard, a small object store.
Its processes are the cluster's own children, stopped by ``Cluster.shutdown`` by their ids."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
from ray.cluster_utils import Cluster

from bunshin_async import HostError
from bunshin_async.integrations.ray import HostConfig, HostRef, RayCluster
from tests._leaks import children, leftovers
from tests.cache.conftest import RedisServer
from tests.transfer._homes import Home

ROOT = Path(__file__).resolve().parents[2]
LEASE = 3.0
LIMIT = 4
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 96 << 20}


class RayEnv:
    def __init__(self) -> None:
        self.temp = tempfile.mkdtemp(prefix="ray-bs-", dir="/tmp")
        self.redis_dir = Path(tempfile.mkdtemp(prefix="bunshin-redis-"))
        self.redis = RedisServer(self.redis_dir)
        self.redis.start()
        self.homes = [Home("n0"), Home("n1")]
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        # Cluster.add_node records the head's address in Ray's default temp dir whatever temp_dir says, and only a
        # node started there creates it: on a machine that never ran Ray it is missing
        Path(tempfile.gettempdir(), "ray").mkdir(exist_ok=True)
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={**NODE_ARGS, "include_dashboard": False, "temp_dir": self.temp},
        )
        self.nodes = [self.cluster.head_node, self.cluster.add_node(**NODE_ARGS)]
        self.cluster.wait_for_nodes()
        import ray

        ray.init(
            address=self.cluster.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )

    def configs(self, **overrides: Any) -> dict[str, HostConfig]:
        out = {}
        for node, home in zip(self.nodes, self.homes, strict=True):
            env = {**home.env, "BUNSHIN_FORK_MODE": "cow"}
            out[node.node_id] = HostConfig(
                max_workspaces=LIMIT, lease_seconds=LEASE, env=env, redis_url=self.redis.url, **overrides
            )
        return out

    def names(self) -> dict[str, str]:
        return {node.node_id: f"n{i}" for i, node in enumerate(self.nodes)}

    def stop(self) -> None:
        import ray

        ray.shutdown()
        if getattr(self, "cluster", None) is not None:
            self.cluster.shutdown()
        self.redis.stop()
        shutil.rmtree(self.redis_dir, ignore_errors=True)
        shutil.rmtree(self.temp, ignore_errors=True)
        for home in self.homes:
            home.remove()


@pytest.fixture(scope="module")
def ray_env() -> Iterator[RayEnv]:
    env = RayEnv()
    try:
        yield env
    finally:
        env.stop()


@pytest.fixture(scope="module")
def hosts(ray_env: RayEnv) -> Iterator[RayCluster]:
    """The host actors, one per node, started once per module by the first test that needs them (a test that
    kills one starts it again: ``restart_host``); each test's ``cluster`` is a client of its own over them."""
    base = anyio.run(lambda: RayCluster.start(ray_env.configs(), names=ray_env.names()))
    yield base
    for h in base.hosts:
        try:
            anyio.run(h.raw, "shutdown")
        except Exception:
            pass


@pytest.fixture
async def cluster(hosts: RayCluster) -> AsyncIterator[RayCluster]:
    async with RayCluster(hosts.hosts, lease_seconds=LEASE) as c:
        yield c
    for h in hosts.hosts:
        try:
            await h.raw("forget")
        except Exception:
            pass


@pytest.fixture(autouse=True)
async def no_leaks(ray_env: RayEnv) -> AsyncIterator[None]:
    """Replaces the root leak check: Ray starts worker processes whenever it likes, so the driver's children are
    not counted; every host's directories, cgroups and processes are, after every test."""
    yield
    assert not await leftovers(ignore_children=children())
    with anyio.move_on_after(60):  # a hang guard: a host frees what a test's owner left on its own time
        while any(h.leftovers() for h in ray_env.homes):
            await anyio.sleep(0.1)
    left = [f"{h.cgroup_parent}: {x}" for h in ray_env.homes for x in h.leftovers()]
    assert not left, f"left behind on the hosts: {left}"


async def kill_host(host: HostRef) -> None:
    """Kill a host's actor and return once it answers no more: ``ray.kill`` only asks, and a call that reached the
    actor before it died would still succeed."""
    ray.kill(host.actor, no_restart=True)
    with anyio.fail_after(60):
        while True:
            try:
                await host.info()
            except HostError:
                return
            await anyio.sleep(0.1)


async def restart_host(hosts: RayCluster, name: str, config: HostConfig) -> None:
    """Start host ``name`` again on its node (after ``kill_host``) in ``hosts``'s list: it collects what the killed
    one left there, so the leak check sees nothing and later tests find every host alive."""
    try:
        await hosts.host(name).info()
        return  # alive: never killed (a test that failed before its kill)
    except HostError:
        pass
    node_id = hosts.host(name).node_id
    with anyio.fail_after(60):
        while True:  # the killed actor's name is free once Ray has seen it die
            try:
                fresh = await RayCluster.start({node_id: config}, names={node_id: name})
                break
            except ValueError:
                await anyio.sleep(0.5)
    hosts.hosts = [fresh.hosts[0] if h.name == name else h for h in hosts.hosts]
