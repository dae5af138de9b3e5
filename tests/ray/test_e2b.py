"""One E2B endpoint in front of the two-node Ray test cluster (``E2BServer(ray=...)``), driven by the unmodified
``e2b`` SDK: sandboxes spread over both nodes, a fork of a sandbox whose host is nearly full (copies beside it, the
rest restored on the other node from its shipped snapshot), the single-host suite's tests of every envd operation,
lifecycle call and error (imported from tests/e2b/test_sdk.py, with this module's server), a host that dies
(its sandboxes unreachable, the other node's unaffected), and nothing left on either node afterwards;
``bunshin e2b serve --ray ADDRESS`` starts its hosts and stops them.

Not imported: the 32 concurrent creates (this cluster has 20 slots; the 16 above cover it), the fork test's PSS
measure (it reads a local workspace's cgroup; the fork above checks the copies' memory by content) and the Docker
reference (remote hosts do not import from this machine's Docker engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import anyio.from_thread
import e2b
import pytest
import ray
import uvicorn
from e2b import AsyncSandbox

from bunshin_async import Limits, ServeError
from bunshin_async._e2b._ray import RayBackend, RemoteHandle
from bunshin_async.integrations.e2b import E2BServer
from bunshin_async.integrations.ray import HostConfig, HostRef, RayCluster, RemoteWorkspace
from tests.e2b.conftest import Served
from tests.e2b.test_sdk import (  # the single-host suite, run here against sandboxes on the cluster
    _ask,
    _start_holder,
    test_a_dead_client_leaves_nothing_after_its_timeout,  # noqa: F401
    test_async_background_stream_stdin_kill,  # noqa: F401
    test_async_snapshot_and_pause_resume,  # noqa: F401
    test_async_template_build_is_a_snapshot_of_the_built_workspace,  # noqa: F401
    test_async_watch_dir_sees_create_write_remove,  # noqa: F401
    test_auth_and_errors,  # noqa: F401
    test_sync_files_round_trip,  # noqa: F401
    test_sync_lifecycle_commands_and_exit_code,  # noqa: F401
)
from tests.ray.conftest import LEASE, ROOT, RayEnv, kill_host, restart_host

SLOTS = 10
"""Workspaces per node: 16 sandboxes take 8 + 8, so a fork of 4 finds 2 free slots beside its parent."""


def configs(ray_env: RayEnv) -> dict[str, HostConfig]:
    return {
        node.node_id: HostConfig(
            max_workspaces=SLOTS, lease_seconds=LEASE, env={**home.env, "BUNSHIN_FORK_MODE": "cow"}
        )
        for node, home in zip(ray_env.nodes, ray_env.homes, strict=True)
    }


@pytest.fixture(scope="module")
def e2b_hosts(ray_env: RayEnv) -> Iterator[RayCluster]:
    hosts = anyio.run(lambda: RayCluster.start(configs(ray_env), names=ray_env.names()))
    yield hosts
    for h in hosts.hosts:
        try:
            assert anyio.run(h.raw, "shutdown") == []
        finally:
            ray.kill(h.actor)


@pytest.fixture
def e2b_server(e2b_hosts: RayCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The server in front of the cluster, on a loop of its own (a thread) as tests/e2b runs it: this module's
    ``e2b_server`` replaces tests/e2b's for the single-host suite's tests imported below."""
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(E2BServer(ray=e2b_hosts)) as server,
    ):
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("E2B_DOMAIN", "bunshin.localhost")
        yield Served(server, portal)
        assert isinstance(server.sandboxes.backend, RayBackend)
    for info in anyio.run(e2b_hosts.infos):  # the server's owner freed everything it made on both hosts
        assert info is not None and (info.workspaces, info.in_use, info.snapshots) == (0, 0, 0), info


@pytest.fixture(autouse=True)
def no_mounts(ray_env: RayEnv) -> Iterator[None]:
    """Beside the hosts' leak check (directories, cgroups, processes): no mount left below either host's dirs."""
    yield
    below = [f"{h.root}/" for h in ray_env.homes] + [f"{h.snapdir}/" for h in ray_env.homes]
    with open("/proc/self/mountinfo") as f:
        left = [line.split()[4] for line in f if any(line.split()[4].startswith(b) for b in below)]
    assert not left, left


def node(server: E2BServer, sbx: AsyncSandbox) -> str:
    handle = server.sandboxes.get(sbx.sandbox_id).ws
    assert isinstance(handle, RemoteHandle)
    return handle.node


async def test_sandboxes_spread_over_both_nodes_and_a_fork_crosses_to_the_other(e2b_server: Served) -> None:
    served = e2b_server.server
    sandboxes: list[AsyncSandbox] = []
    copies: list[AsyncSandbox] = []

    async def create(i: int) -> None:
        sandboxes.append(await AsyncSandbox.create(metadata={"i": str(i)}))

    try:
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(create, i)
        nodes = [node(served, s) for s in sandboxes]
        # The roomiest host each time, each sandbox counted once (by the server until its host lists it): 8 + 8.
        assert (nodes.count("n0"), nodes.count("n1")) == (8, 8), nodes
        fuller, other = "n0", "n1"
        beside = SLOTS - 8  # 2: the fork crosses to the other node
        parent = next(s for s in sandboxes if node(served, s) == fuller)
        await parent.files.write("/home/user/state.txt", "parent")
        pid = await _start_holder(parent)
        before = await _ask(parent, pid)
        copies = [c for c in await parent.fork(count=4) if isinstance(c, AsyncSandbox)]
        assert len(copies) == 4
        # beside the parent as many as its host's free slots, the rest restored on the other node from the parent's
        # snapshot shipped there
        assert sorted(node(served, c) for c in copies) == sorted([fuller] * beside + [other] * (4 - beside))
        limits = Limits()  # what the hosts make a sandbox with (the server asks for no other)
        for i, copy in enumerate(copies):
            info = await copy.get_info()  # beside the parent or restored on the other node: the host's figures
            assert (info.cpu_count, info.memory_mb) == (1, (limits.memory or 0) >> 20)
            assert await copy.files.read("/home/user/state.txt") == "parent"
            assert pid in [p.pid for p in await copy.commands.list()]
            assert await _ask(copy, pid) == before  # the same token and heap: the process with its memory
            await copy.files.write("/home/user/state.txt", f"copy {i}")
        for i, copy in enumerate(copies):
            assert await copy.files.read("/home/user/state.txt") == f"copy {i}"
        assert await parent.files.read("/home/user/state.txt") == "parent"
    finally:
        async with anyio.create_task_group() as tg:
            for s in [*sandboxes, *copies]:
                tg.start_soon(s.kill)


async def test_a_create_whose_reply_is_late_is_counted_once(
    e2b_server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox is counted once in placement: a create its host has made, whose reply has not reached the server
    yet, is in the host's count (its info lists the create's claim), not in the server's reservations too. With one
    sandbox on n0 and the reply of one on n1 held back, the next two go to n0 and n1 (2 + 2), not both to n0."""
    made, go = threading.Event(), threading.Event()
    real = HostRef.make

    async def make(self: HostRef, method: str, *args: Any, release: Any) -> Any:
        out = await real(self, method, *args, release=release)
        if method == "create" and "HOLD" in args[3]:  # owner, image, limits, env, ...
            made.set()
            await anyio.to_thread.run_sync(go.wait)  # the reply is late
        return out

    monkeypatch.setattr(HostRef, "make", make)
    served = e2b_server.server
    sandboxes: list[AsyncSandbox] = []
    try:
        sandboxes.append(await AsyncSandbox.create())
        async with anyio.create_task_group() as tg:

            async def held() -> None:
                sandboxes.insert(1, await AsyncSandbox.create(envs={"HOLD": "1"}))

            tg.start_soon(held)
            try:
                assert await anyio.to_thread.run_sync(made.wait, 120)
                for _ in range(2):
                    sandboxes.append(await AsyncSandbox.create())
            finally:
                go.set()
        assert [node(served, s) for s in sandboxes] == ["n0", "n1", "n0", "n1"]
        info = await sandboxes[1].get_info()  # and a remote sandbox reports the limits its host made it with
        assert (info.cpu_count, info.memory_mb) == (1, (Limits().memory or 0) >> 20)
    finally:
        go.set()
        async with anyio.create_task_group() as tg:
            for s in sandboxes:
                tg.start_soon(s.kill)


async def test_a_server_that_fails_to_start_releases_its_cluster_owner(
    e2b_hosts: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that fails after the backend opened (uvicorn exits in its startup, injected) closes the backend: the
    owner's lease renewal stops and the server's error says why."""

    async def startup(self: uvicorn.Server, sockets: Any = None) -> None:
        sys.exit(3)  # what uvicorn does when its start fails

    monkeypatch.setattr(uvicorn.Server, "startup", startup)
    before = {t.ident for t in threading.enumerate()}
    server = E2BServer(ray=e2b_hosts)
    with pytest.raises(ServeError, match="did not start"):
        await server.__aenter__()
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.name == "bunshin-lease"] == []
    assert isinstance(server.sandboxes.backend, RayBackend) and server.sandboxes.backend._cluster is None


def _host_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("bunshin-host")]


async def test_serve_with_ray_starts_a_host_per_node_and_stops_them(ray_env: RayEnv, e2b_hosts: RayCluster) -> None:
    before = set(_host_actors())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "bunshin_async", "e2b", "serve", "--port", "0", "--ray", ray_env.cluster.address]
    argv += ["--ray-slots", "2"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stdout is not None
            exports: dict[str, str] = {}
            for _ in range(3):  # export E2B_API_URL=..., E2B_SANDBOX_URL, E2B_API_KEY
                line = await anyio.to_thread.run_sync(proc.stdout.readline)
                key, _, value = line.strip().removeprefix("export ").partition("=")
                exports[key] = value
            started = set(_host_actors()) - before
            assert len(started) == 2  # one per alive node
            opts = {"api_url": exports["E2B_API_URL"], "api_key": exports["E2B_API_KEY"]}
            sbx = await AsyncSandbox.create(sandbox_url=exports["E2B_SANDBOX_URL"], **opts)
            assert (await sbx.commands.run("echo remote")).stdout == "remote\n"
            # a second server on the same cluster: its hosts' names are taken, a clear error and no traceback
            second = await anyio.to_thread.run_sync(
                lambda: subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
            )
            assert second.returncode == 1 and "already run" in second.stderr, second.stderr
            assert "Traceback" not in second.stderr
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await anyio.to_thread.run_sync(proc.communicate)
    assert proc.returncode == 0, err
    with anyio.fail_after(30):  # killed actors leave the list once their processes are gone
        while set(_host_actors()) - before:
            await anyio.sleep(0.2)
    refused = subprocess.run([*argv[:-1], "0"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 2 and "at least one workspace slot" in refused.stderr


async def test_an_error_inside_a_live_host_is_an_error_of_that_call(
    e2b_server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that raises something other than a ``BunshinError`` (a real TypeError in the host: the injected fault
    sends the workspace's spawn an argument it does not take) fails that command with a clear error; the sandbox
    is not reported unreachable and goes on running commands."""
    real = RemoteWorkspace.spawn

    async def spawn(self: RemoteWorkspace, cmd: Sequence[str], **kwargs: Any) -> int:
        if "host-fault" in " ".join(cmd):
            kwargs["no_such_argument"] = 1
        return await real(self, cmd, **kwargs)

    monkeypatch.setattr(RemoteWorkspace, "spawn", spawn)
    sbx = await AsyncSandbox.create()
    try:
        with pytest.raises(e2b.exceptions.SandboxException, match="TypeError in host") as failed:
            await sbx.commands.run("echo host-fault")
        assert not isinstance(failed.value, e2b.exceptions.SandboxUnreachableException), failed.value
        assert (await sbx.commands.run("echo alive")).stdout == "alive\n"
        assert await sbx.is_running()
    finally:
        await sbx.kill()


async def test_a_dead_host_stops_its_sandboxes_only(ray_env: RayEnv, e2b_hosts: RayCluster, e2b_server: Served) -> None:
    doomed, other = await AsyncSandbox.create(), await AsyncSandbox.create()  # one on each node
    victim = e2b_hosts.host(node(e2b_server.server, doomed))
    assert node(e2b_server.server, other) != victim.name
    try:
        running = await doomed.commands.run("sleep 600", background=True)  # its stream is open when the host dies
        await kill_host(victim)
        gone = f"gone with its host: host {victim.name}"
        with pytest.raises(e2b.exceptions.SandboxUnreachableException, match=f"stream of process .* ended: .*{gone}"):
            await running.wait()
        with pytest.raises(e2b.exceptions.SandboxUnreachableException, match=gone):
            await doomed.commands.run("true")
        assert (await other.commands.run("echo alive")).stdout == "alive\n"
        await doomed.kill()  # the server forgets it; its host is gone already
        await other.kill()
    finally:
        await restart_host(e2b_hosts, victim.name, configs(ray_env)[victim.node_id])
