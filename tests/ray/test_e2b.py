"""One E2B endpoint in front of the two-node Ray test cluster (``E2BServer(ray=...)``), driven by the unmodified
``e2b`` SDK: sandboxes spread over both nodes, a fork of a sandbox whose host is nearly full (live copies beside it,
the rest restored on the other node from its shipped snapshot), every envd operation on a remote sandbox, and
nothing left on either node afterwards; ``bunshin e2b serve --ray ADDRESS`` starts its hosts and stops them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import anyio
import anyio.from_thread
import e2b
import pytest
import ray
from e2b import AsyncSandbox, CommandExitException, FileNotFoundException, NotFoundException

from bunshin_async._e2b._ray import RemoteHandle
from bunshin_async.integrations.e2b import E2BServer
from bunshin_async.integrations.ray import HostConfig, RayCluster
from tests.e2b.test_sdk import _ask, _start_holder
from tests.ray.conftest import LEASE, ROOT, RayEnv

SLOTS = 10
"""Workspaces per node: 16 sandboxes take 8 + 8, so a fork of 4 finds 2 free slots beside its parent."""


@pytest.fixture(scope="module")
def e2b_hosts(ray_env: RayEnv) -> Iterator[RayCluster]:
    configs = {
        node.node_id: HostConfig(
            max_workspaces=SLOTS, lease_seconds=LEASE, env={**home.env, "BUNSHIN_FORK_MODE": "cow"}
        )
        for node, home in zip(ray_env.nodes, ray_env.homes, strict=True)
    }
    hosts = anyio.run(lambda: RayCluster.start(configs, names=ray_env.names()))
    yield hosts
    for h in hosts.hosts:
        try:
            assert anyio.run(h.raw, "shutdown") == []
        finally:
            ray.kill(h.actor)


@pytest.fixture
def served(e2b_hosts: RayCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[E2BServer]:
    """The server on a loop of its own (a thread), as tests/e2b runs it."""
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(E2BServer(ray=e2b_hosts)) as server,
    ):
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("E2B_DOMAIN", "bunshin.localhost")
        yield server
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


async def test_sandboxes_spread_over_both_nodes_and_a_fork_crosses_to_the_other(served: E2BServer) -> None:
    sandboxes: list[AsyncSandbox] = []
    copies: list[AsyncSandbox] = []

    async def create(i: int) -> None:
        sandboxes.append(await AsyncSandbox.create(metadata={"i": str(i)}))

    try:
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(create, i)
        nodes = [node(served, s) for s in sandboxes]
        assert sorted(set(nodes)) == ["n0", "n1"]
        assert nodes.count("n0") == nodes.count("n1") == 8  # the roomiest host each time, ties to the first
        parent = next(s for s in sandboxes if node(served, s) == "n0")
        await parent.files.write("/home/user/state.txt", "parent")
        pid = await _start_holder(parent)
        before = await _ask(parent, pid)
        copies = [c for c in await parent.fork(count=4) if isinstance(c, AsyncSandbox)]
        assert len(copies) == 4
        # two beside the parent (its host's free slots), two restored on n1 from the parent's snapshot shipped there
        assert sorted(node(served, c) for c in copies) == ["n0", "n0", "n1", "n1"]
        for i, copy in enumerate(copies):
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


async def test_envd_on_a_remote_sandbox(served: E2BServer) -> None:
    sbx = await AsyncSandbox.create(envs={"FROM_CREATE": "yes"})
    try:
        assert node(served, sbx) in ("n0", "n1")
        # commands: exit code and both streams, environment, cwd
        with pytest.raises(CommandExitException) as failed:
            await sbx.commands.run("echo hi; echo err >&2; exit 3")
        assert (failed.value.exit_code, failed.value.stdout, failed.value.stderr) == (3, "hi\n", "err\n")
        res = await sbx.commands.run('echo "$FROM_CREATE $PWD"', cwd="/tmp")
        assert res.stdout == "yes /tmp\n"
        # a background command streamed as produced, given stdin, listed, killed
        out: list[str] = []
        echoed = anyio.Event()

        def on_stdout(chunk: str) -> None:
            out.append(chunk)
            if "ping" in "".join(out):
                echoed.set()

        handle = await sbx.commands.run("cat", background=True, stdin=True, on_stdout=on_stdout, timeout=0)
        await sbx.commands.send_stdin(handle.pid, "ping\n")
        with anyio.fail_after(30):
            await echoed.wait()
        assert handle.pid in [p.pid for p in await sbx.commands.list()]
        assert await handle.kill()
        with pytest.raises(CommandExitException) as killed:
            await handle.wait()
        assert killed.value.exit_code == 128 + signal.SIGKILL
        assert handle.pid not in [p.pid for p in await sbx.commands.list()]
        with pytest.raises(e2b.TimeoutException):  # the command's timeout kills it
            await sbx.commands.run("sleep 30", timeout=1)
        # files: write, read, list, rename, make_dir, info, remove
        await sbx.files.write("/tmp/t/a.txt", "hello\n")
        assert await sbx.files.read("/tmp/t/a.txt") == "hello\n"
        assert await sbx.files.read("/tmp/t/a.txt", format="bytes") == b"hello\n"
        assert [e.name for e in await sbx.files.list("/tmp/t")] == ["a.txt"]
        await sbx.files.rename("/tmp/t/a.txt", "/tmp/t/b.txt")
        assert not await sbx.files.exists("/tmp/t/a.txt")
        assert await sbx.files.make_dir("/tmp/t/sub")
        assert (await sbx.files.get_info("/tmp/t/b.txt")).size == 6
        await sbx.files.remove("/tmp/t/b.txt")
        with pytest.raises(FileNotFoundException):
            await sbx.files.read("/tmp/t/b.txt")
        # a snapshot, a sandbox from it, pause and resume: all on the cluster
        await sbx.files.write("/home/user/state.txt", "snapped")
        snap = await sbx.create_snapshot()
        made = await AsyncSandbox.create(snap.snapshot_id)
        try:
            assert await made.files.read("/home/user/state.txt") == "snapped"
        finally:
            await made.kill()
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id)
        await sbx.pause()
        resumed = await AsyncSandbox.connect(sbx.sandbox_id)
        assert await resumed.files.read("/home/user/state.txt") == "snapped"
    finally:
        await sbx.kill()
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(sbx.sandbox_id)


async def test_watch_and_template_build_on_the_cluster(served: E2BServer) -> None:
    async with await AsyncSandbox.create() as sbx:
        await sbx.files.make_dir("/tmp/w")
        seen: list[tuple[str, str]] = []
        handle = await sbx.files.watch_dir("/tmp/w", on_event=lambda e: seen.append((e.name, e.type.value)), timeout=0)
        try:
            await sbx.files.write("/tmp/w/a.txt", "x")
            with anyio.fail_after(20):
                while ("a.txt", "create") not in seen:
                    await anyio.sleep(0.05)
        finally:
            await handle.stop()
    # a build runs its steps in a workspace on a host (environment and user set through the host actor) and keeps
    # its snapshot there; a sandbox of the template is a restore of it
    template = (
        e2b.Template()
        .from_template("base")
        .set_envs({"GREETING": "built"})
        .run_cmd("useradd -m builder && mkdir -p /srv/app && echo marker > /srv/app/marker")
        .set_workdir("/srv/app")
        .set_user("builder")
    )
    logs: list[str] = []
    await e2b.AsyncTemplate.build(template, "ray-tpl", on_build_logs=lambda e: logs.append(e.message))
    assert any("build ready" in line for line in logs), logs
    async with await AsyncSandbox.create("ray-tpl") as sbx:
        res = await sbx.commands.run("cat marker; pwd; echo $GREETING; id -un")
        assert res.stdout == "marker\n/srv/app\nbuilt\nbuilder\n"
        assert isinstance(served.sandboxes.get(sbx.sandbox_id).ws, RemoteHandle)


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
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await anyio.to_thread.run_sync(proc.communicate)
    assert proc.returncode == 0, err
    with anyio.fail_after(30):  # killed actors leave the list once their processes are gone
        while set(_host_actors()) - before:
            await anyio.sleep(0.2)
