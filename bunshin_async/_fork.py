"""Live fork, snapshot and rollback of running workspaces with CRIU.

A snapshot is a CRIU dump of the workspace's whole process tree (``leave_running``: the parent carries on) plus a
copy of its overlay upper dir taken in the ``post-dump`` notification, while the tree is still frozen, so memory and
files are one moment. Both live on tmpfs (``BUNSHIN_SNAPDIR``, default ``/dev/shm/bunshin-snap``).

A fork is a restore of that snapshot into a new workspace: a new id, cgroup and directory, and its own copy of the
snapshot's upper dir under a fresh overlay. CRIU recreates the tree's own mount, pid, net, ipc and uts namespaces
(they differ from CRIU's, so they are in the images); the overlay root is handed to it as ``root`` (as runc does),
mounted by a wrapper in a private mount namespace that exists only for the restore, so no host mount is ever
made. The wrapper first moves itself into the new cgroup; CRIU runs with ``manage_cgroups_mode=IGNORE``, so the
restored tree simply inherits it.

Who reaps the restored pid 1, and who kills it when the host dies: ``rst_sibling`` makes CRIU clone the root task
with ``CLONE_PARENT`` (cr-restore.c, ``maybe_clone_parent``), so the restored pid 1 is a child of this process, not
of CRIU. CRIU restores its ``PR_SET_PDEATHSIG(SIGKILL)`` (pie/restorer.c, ``restore_pdeath_sig``), so if the host
dies the kernel kills pid 1 and with it the whole pid namespace, as for a fresh workspace (where the shim is in
between). ``Workspace._teardown`` reaps it through its pidfd.

Policy for calls in flight: a snapshot waits for the workspace's running tool calls to finish (new ones wait for the
snapshot), because a connection from the host cannot be dumped; the agent's listening socket can, and is restored.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from . import _paths
from . import _protocol as P
from ._client import AgentClient
from ._criu import CriuBackend, SwrkCriu, rpc
from ._exceptions import ForkError, WorkspaceClosed
from ._image import Image
from ._kernel import Cgroup, Limits

if TYPE_CHECKING:
    from ._workspace import Workspace

__all__ = ["ForkMode", "Snapshot", "snapshot_dir"]

ForkMode = str
"""How a workspace came to be: ``"fresh"`` (started cold), ``"criu"`` (restored from a CRIU snapshot)."""

DRAIN_TIMEOUT = 60.0
DUMP_TIMEOUT = 120.0
RESTORE_TIMEOUT = 120.0
LOG_LEVEL = int(os.environ.get("BUNSHIN_CRIU_LOG_LEVEL", "2"))


def snapshot_dir() -> Path:
    """Where snapshots live; a tmpfs, so that images and the upper copy cost no disk I/O."""
    return Path(os.environ.get("BUNSHIN_SNAPDIR", "/dev/shm/bunshin-snap"))


def default_backend() -> CriuBackend:
    return SwrkCriu()


class Snapshot:
    """A frozen moment of a workspace: CRIU images and the upper dir. Owns its directory; ``aclose()`` removes
    it (idempotent). Workspaces restored from it do not need it afterwards."""

    def __init__(
        self,
        *,
        workspace_id: str,
        lower: str,
        image: Image,
        limits: Limits,
        workdir: str,
        env: dict[str, str],
        hostname: str,
        max_output: int,
    ) -> None:
        self.id = secrets.token_hex(6)
        self.workspace_id = workspace_id
        self.path = snapshot_dir() / self.id
        self.lower = lower
        self.image = image
        self.limits = limits
        self.workdir = workdir
        self.env = env
        self.hostname = hostname
        self.max_output = max_output
        self.dump_ms: float | None = None
        self.frozen_ms: float | None = None
        self._closed = False

    @property
    def images(self) -> Path:
        return self.path / "images"

    @property
    def upper(self) -> Path:
        return self.path / "upper"

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        self._closed = True
        if self.path.exists():
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(shutil.rmtree, self.path, True)

    async def __aenter__(self) -> Snapshot:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} of {self.workspace_id}>"


# ---------------------------------------------------------------------------------------------------- quiescing


class GatedAgentClient(AgentClient):
    """An ``AgentClient`` that can be paused: ``quiesce()`` lets calls in flight finish, holds new ones and closes
    every idle connection, so that the agent holds no connection to the host while CRIU dumps it."""

    def __init__(self, socket_path: str, workspace_id: str) -> None:
        super().__init__(socket_path, workspace_id)
        self._open = anyio.Event()
        self._open.set()
        self._in_flight = 0
        self._drained = anyio.Event()

    async def request(self, req: P.Request) -> P.Response:
        while not self._open.is_set():
            await self._open.wait()
        self._in_flight += 1
        try:
            return await super().request(req)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    async def quiesce(self) -> None:
        self._open = anyio.Event()
        while self._in_flight:
            self._drained = anyio.Event()
            await self._drained.wait()
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    def resume(self) -> None:
        self._open.set()


def _gated(ws: Workspace) -> GatedAgentClient:
    client = ws._client
    if isinstance(client, GatedAgentClient):
        return client
    if client is None:
        raise WorkspaceClosed(f"workspace {ws.id} is {ws._state}", workspace_id=ws.id)
    gated = GatedAgentClient(client.socket_path, ws.id)
    ws._client = gated
    # Calls in flight on the old client close their connection when they end instead of pooling it.
    client._closed = True
    for conn in client._idle:
        conn._raw_socket.close()  # type: ignore[attr-defined]
    client._idle = []
    return gated


def _agent_connections(pid: int) -> int:
    """Connected (state 03) sockets bound to the agent's path in the workspace's net namespace
    (/proc/<pid>/net/unix; columns per unix(7) and net/unix/af_unix.c ``unix_seq_show``)."""
    n = 0
    with open(f"/proc/{pid}/net/unix") as f:
        next(f)
        for line in f:
            cols = line.split()
            if len(cols) >= 8 and cols[5] == "03" and cols[7] == "/run/bunshin/agent.sock":
                n += 1
    return n


async def _drain(ws: Workspace) -> GatedAgentClient:
    gated = _gated(ws)
    with anyio.move_on_after(DRAIN_TIMEOUT) as scope:
        await gated.quiesce()
        assert ws.pid is not None
        delay = 0.0005
        while _agent_connections(ws.pid):  # the agent closes its end once it reads our hang-up
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.02)
    if scope.cancelled_caught:
        gated.resume()
        raise ForkError(f"workspace {ws.id}: tool calls did not finish within {DRAIN_TIMEOUT} s", workspace_id=ws.id)
    return gated


# ---------------------------------------------------------------------------------------------------- dump


def _base_opts(req: Any) -> None:
    req.opts.log_level = LOG_LEVEL
    req.opts.tcp_established = True
    req.opts.file_locks = True
    req.opts.manage_cgroups = True
    req.opts.manage_cgroups_mode = rpc.IGNORE


async def _copy_tree(src: Path, dst: Path) -> None:
    # cp keeps overlay's trusted.* xattrs (whiteouts, opaque dirs, origin), which shutil.copytree does not.
    await anyio.run_process(["cp", "-a", "--reflink=auto", "--", str(src), str(dst)])


async def snapshot(ws: Workspace, backend: CriuBackend | None = None) -> Snapshot:
    from ._image import agent_layer

    if ws._state != "running" or ws.pid is None:
        raise WorkspaceClosed(f"workspace {ws.id} is {ws._state}", workspace_id=ws.id)
    backend = backend or default_backend()
    layer = await anyio.to_thread.run_sync(agent_layer)
    snap = Snapshot(
        workspace_id=ws.id,
        lower=f"{layer}:{ws.image.rootfs}",
        image=ws.image,
        limits=ws.limits,
        workdir=ws.workdir,
        env=dict(ws.env),
        hostname=ws.hostname,
        max_output=ws.max_output,
    )
    snap.images.mkdir(parents=True)
    gated: GatedAgentClient | None = None
    try:
        gated = await _drain(ws)
        freezer = ws.cgroup.freezer_dir if ws.cgroup is not None else None
        req = rpc.criu_req(type=rpc.DUMP, notify_success=False)
        _base_opts(req)
        req.opts.pid = ws.pid
        req.opts.leave_running = True
        req.opts.network_lock = rpc.NFTABLES
        req.opts.notify_scripts = True
        if freezer is not None:
            req.opts.freeze_cgroup = str(freezer)
        frozen_at: list[float] = []

        async def on_notify(name: str, pid: int) -> None:
            if name == "post-dump":
                frozen_at.append(time.monotonic())
                await _copy_tree(ws.directory / "upper", snap.upper)

        fd = os.open(snap.images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            req.opts.images_dir_fd = fd
            t0 = time.monotonic()
            await backend.call(
                req,
                work_dir=snap.images,
                log_name="dump.log",
                workspace_id=ws.id,
                notify=on_notify,
                timeout=DUMP_TIMEOUT,
            )
            snap.dump_ms = (time.monotonic() - t0) * 1000
        finally:
            os.close(fd)
        if not snap.upper.is_dir():
            raise ForkError(f"workspace {ws.id}: CRIU never sent post-dump", workspace_id=ws.id)
    except BaseException:
        await snap.aclose()
        raise
    finally:
        if gated is not None:
            gated.resume()
    return snap


# ---------------------------------------------------------------------------------------------------- restore


def _wrapper(cgroup: Cgroup, lower: str, upper: Path, work: Path, root: Path) -> list[str]:
    """unshare(1) gives the restore a private mount namespace (no host mount, nothing to clean up if we die); the
    shell joins the cgroup and mounts the root overlay there, then execs CRIU (same pid: still our child)."""
    opts = f"lowerdir={lower},upperdir={upper},workdir={work},index=on,nfs_export=on"
    joins = "".join(f"echo $$ > {shlex.quote(p)} && " for p in cgroup.procs_files)
    script = f'{joins}mount -t overlay overlay -o {shlex.quote(opts)} {shlex.quote(str(root))} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh"]


async def _reap_strays(cgroup: Cgroup) -> None:
    """After a failed restore, kill what CRIU left and reap those that are our children (rst_sibling)."""
    me = os.getpid()
    for pid in cgroup.pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            os.kill(pid, 9)
            if ppid == me:
                await anyio.to_thread.run_sync(os.waitpid, pid, 0)
        except (OSError, ValueError, IndexError):
            pass


async def restore_into(ws: Workspace, snap: Snapshot, backend: CriuBackend | None = None) -> None:
    """Make ``ws`` (state "new", its directory absent) a live copy of ``snap``. On failure everything made for it
    is removed and ``ForkError`` raised."""
    if snap.closed:
        raise ForkError(f"snapshot {snap.id} is closed", workspace_id=ws.id)
    backend = backend or default_backend()
    ws._state = "starting"
    try:
        ws._dir.mkdir(parents=True)
        for sub in ("work", "root"):
            (ws._dir / sub).mkdir()
        await _copy_tree(snap.upper, ws._dir / "upper")
        ws._cgroup = Cgroup.create(f"ws-{ws.id}", ws.limits)
        req = rpc.criu_req(type=rpc.RESTORE)
        _base_opts(req)
        req.opts.root = str(ws._dir / "root")
        req.opts.rst_sibling = True
        fd = os.open(snap.images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            req.opts.images_dir_fd = fd
            wrapper = _wrapper(ws._cgroup, snap.lower, ws._dir / "upper", ws._dir / "work", ws._dir / "root")
            try:
                resp = await backend.call(
                    req,
                    work_dir=ws._dir,
                    log_name="restore.log",
                    workspace_id=ws.id,
                    wrapper=wrapper,
                    timeout=RESTORE_TIMEOUT,
                )
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await _reap_strays(ws._cgroup)
                raise
        finally:
            os.close(fd)
        ws.pid = int(resp.restore.pid)
        ws._pidfd = os.pidfd_open(ws.pid)
        ws._client = AgentClient(f"/proc/{ws.pid}/root/run/bunshin/agent.sock", ws.id)
        ws._state = "running"
    except BaseException:
        with anyio.CancelScope(shield=True):
            await ws._teardown()
        ws._state = "closed"
        raise


def reap_pid1(pidfd: int) -> None:
    """Wait for a restored pid 1 (our child through rst_sibling) so that it leaves no zombie. Blocking."""
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
    except ChildProcessError:
        pass
