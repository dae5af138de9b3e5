"""``WorkspaceCore``: the one owner of a workspace's host state.

A core holds what a workspace is on the host: its directory, cgroup, pid 1 (with its pidfd, and the shim of a cold
start), the agent connection, the overlay's lower-layer chain and the snapshot its memory is mapped from, its state
(new -> starting -> running -> closed) and the record of its spawns. It starts pid 1 cold (``start``), adopts one
that CRIU restored (``adopt``), stops its processes and tears it all down. ``Workspace`` is a facade over a core
(the tools); the fork layer (``bunshin_async._fork``) works on cores and makes the copies' cores itself
(``_fork._restore.new_core``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import shlex
import signal
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from .._exceptions import (
    AgentError,
    CapabilityMissing,
    FileNotFound,
    ImageError,
    InvalidArgument,
    PathOutsideWorkspace,
    PathTooLong,
    ToolError,
    ToolTimeout,
    WorkspaceClosed,
    WorkspaceStartError,
)
from .._host import _kernel, _paths, _security, _tree, _userns
from .._host import _protocol as P
from .._host._client import AgentClient, agent_threads
from .._host._dirlock import lock_dir
from .._host._kernel import Cgroup, Limits, devices_controller, mount_disk, unmount_disk
from .._host._security import Security
from .._host._snapstore import chain_layers, hold_layers, release_layers
from .._host._wptrack import WriteTracking
from .._images._image import AGENT_DIR, Image, agent_layer

log = logging.getLogger("bunshin_async.workspace")

__all__ = ["SetupStep", "WorkspaceCore", "WorkspaceSpec"]

START_TIMEOUT = 30.0
CLOSE_TIMEOUT = 10.0
PATH_MAX = 4096
"""The kernel's limit on a path, its final NUL included (limits.h); the agent refuses a longer one (``PathTooLong``)."""
MOUNT_OPTIONS_MAX = 3600
"""What the image's layers may take of the overlay's options: mount(2) copies one page of them (4096 bytes), which
also hold the agent layer, upper and work dirs (and a fork's snapshot layers)."""


class SetupStep(msgspec.Struct, frozen=True):
    """One ``Workspace.spawn`` as it was sent to the agent (``env`` already merged with the workspace's), recorded
    so that a filesystem-only copy can start the process again."""

    argv: list[str] | None = None
    command: str | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    log_path: str | None = None
    user: str | None = None

    def request(self) -> P.Spawn:
        return P.Spawn(
            argv=self.argv, command=self.command, cwd=self.cwd, env=self.env, log_path=self.log_path, user=self.user
        )

    def __str__(self) -> str:
        return self.command if self.command is not None else shlex.join(self.argv or [])


def _raise_failure(resp: P.Failure, tool: str, timeout: float | None, workspace_id: str) -> None:
    if resp.error == "timeout":
        raise ToolTimeout(resp.message, tool=tool, timeout=timeout or 0.0, stdout=resp.stdout, stderr=resp.stderr)
    if resp.error == "path_outside":
        raise PathOutsideWorkspace(resp.message, tool=tool, path=resp.path or "")
    if resp.error == "not_found":
        raise FileNotFound(resp.message, tool=tool, path=resp.path or "")
    if resp.error == "name_too_long":
        path = resp.path or ""
        length = len(path.encode(errors="surrogateescape"))
        raise PathTooLong(
            f"{tool}: the path ({length} bytes) is longer than the {PATH_MAX}-byte limit of a path in the "
            f"workspace (with the workspace directory and its symlinks resolved): {resp.message}",
            tool=tool,
            path=path,
            length=length,
            limit=PATH_MAX,
        )
    if resp.error == "invalid":
        raise InvalidArgument(resp.message, tool=tool)
    if resp.error == "os":
        raise ToolError(resp.message, tool=tool)
    raise AgentError(f"{tool}: {resp.message}", workspace_id=workspace_id, reason=resp.error, request=tool)


def _mknod_allowed(security: Security) -> bool:
    """MKNOD is kept only where the device allow-list is enforced (or there is none to enforce)."""
    if security.device_rules() is None or devices_controller():
        return True
    _security.log.warning("no cgroup v1 devices controller: MKNOD is dropped instead of a device allow-list")
    return False


def prime_attach() -> None:
    """Let ``_kernel.prime_cgroup_attach`` run while a start or restore is prepared, so that the cgroup attach of
    pid 1 (or of the restore wrapper) need not wait a grace period (~6 ms here). A daemon thread, not a task: it
    has no result, ends by itself within one grace period and must not turn errors into exception groups."""
    threading.Thread(target=_kernel.prime_cgroup_attach, name="bunshin-prime-attach", daemon=True).start()


async def reap_pid1(pidfd: int) -> None:
    """Wait for a restored pid 1 (our child through rst_sibling) to exit and reap it, so it leaves no zombie. A
    pidfd turns readable when its process exits (pidfd_open(2))."""
    await anyio.wait_readable(pidfd)
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 - WNOHANG, it has exited
    except ChildProcessError:
        pass


class WorkspaceSpec(msgspec.Struct, frozen=True):
    """How a workspace is made (``Workspace``'s arguments, resolved): what a snapshot records and its copies get."""

    image: Image | None  # None until the facade resolves its default (``Workspace.image``)
    limits: Limits
    security: Security
    workdir: str
    env: dict[str, str]
    hostname: str
    max_output: int
    user: str | None

    def detached(self) -> WorkspaceSpec:
        """A copy whose ``env`` is its own (a snapshot's must not follow later changes to the workspace's)."""
        return msgspec.structs.replace(self, env=dict(self.env))


class WorkspaceCore:
    """A workspace's host state and its lifecycle (module doc): ``spec`` is how it was made; the rest is host
    state, changed only by this class and the fork layer."""

    def __init__(self, spec: WorkspaceSpec) -> None:
        self.spec = spec
        self.id = secrets.token_hex(6)
        self.dir = _paths.workspaces_dir() / self.id
        self.state = "new"
        self.cgroup: Cgroup | None = None
        self.pid: int | None = None  # host pid of the workspace's pid 1
        self.pidfd: int | None = None
        self.shim: Process | None = None  # bunshin-init of a cold start (a restored pid 1 is our own child)
        self.client: AgentClient | None = None
        self.lower: str | None = None  # overlay lowerdir chain: snapshot layers (forks), agent layer, image
        self.mem_parent: Path | None = None  # snapshot dir a CoW copy's memory is mapped from (held while alive)
        self.tracking = WriteTracking()  # uffds tracking its tasks' writes between dumps (Config.track_writes)
        self.setup: list[tuple[SetupStep, int]] = []  # every spawn in order, with its in-workspace pid
        self.restarted: list[tuple[SetupStep, int]] = []  # a filesystem-only copy's restarted spawns
        self.fork_mode = "fresh"
        self.restore_ms: float | None = None

    def closed_error(self) -> WorkspaceClosed:
        return WorkspaceClosed(f"workspace {self.id} is {self.state}", workspace_id=self.id)

    # ------------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start pid 1 cold over the image. On any failure (cancellation included) everything made is removed."""
        if self.state != "new":
            raise WorkspaceClosed(f"workspace {self.id} was already started", workspace_id=self.id)
        self.state = "starting"
        init = _paths.init_binary()
        if not init.exists():
            raise CapabilityMissing(
                f"{init} is missing",
                capability="bunshin-init",
                remedy="reinstall bunshin (`make setup` in a checkout)",
            )
        if os.geteuid() != 0:
            raise CapabilityMissing(
                "workspaces need root (namespaces, mounts, cgroups)", capability="root", remedy="run as root"
            )
        image = self.spec.image
        assert image is not None
        userns = self.spec.security.userns
        shifts = (len(image.layers) + 2) * _userns.SUFFIX_MAX if userns else 0  # the shifted copies' longer names
        if len(image.lower_dirs) + shifts + 2 * len(str(self.dir)) > MOUNT_OPTIONS_MAX:
            raise ImageError(
                f"image {image.name!r} has too many layers ({len(image.layers)}) for one overlay mount's options "
                f"({MOUNT_OPTIONS_MAX} bytes); squash some of its layers",
                image=image.name,
            )
        async with self.failing_closes():
            prime_attach()  # the shim's cgroup attach then waits no grace period: the agent is ready sooner
            layer = await anyio.to_thread.run_sync(agent_layer)
            await self.make_dirs()
            self.spec.security.log_relaxations(self.id)
            self.create_cgroup()
            self.lower = f"{layer}:{image.lower_dirs}"
            if userns:  # the layers' shifted copies (_userns), made once
                try:
                    self.lower = await anyio.to_thread.run_sync(_userns.shifted_lower, self.lower)
                except (ImageError, OSError) as exc:
                    raise WorkspaceStartError(f"workspace {self.id}: {exc}", workspace_id=self.id) from exc
            await self.spawn()
            self.state = "running"

    @contextlib.asynccontextmanager
    async def failing_closes(self) -> AsyncIterator[None]:
        """``async with core.failing_closes():`` tears everything down and marks the core closed if the body fails
        (cancellation included)."""
        try:
            yield
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.teardown()
            self.state = "closed"
            raise

    async def make_dirs(self, upper: bool = True) -> None:
        """The workspace's host directory, with an ``owner`` file (our pid and start time) for ``bunshin gc``.
        A restored copy makes its upper dir itself (``upper=False``). Made in a shared section of the run dir's lock
        (``_dirlock``), which a collection holds exclusively: ``bunshin gc`` beside us never sees the directory
        without its owner. Waited for in a worker thread only while a collection holds it (it may be this process's
        own first-start collection, whose next step needs the event loop)."""
        base = self.dir.parent
        fd = lock_dir(base, wait=False, make=True)
        if fd is None:
            fd = await anyio.to_thread.run_sync(functools.partial(lock_dir, base, make=True))
        assert fd is not None
        try:
            self._make_dirs(upper)
        finally:
            os.close(fd)

    def _make_dirs(self, upper: bool) -> None:
        if self.spec.limits.disk is not None:  # the upper and work dirs on a tmpfs of that size (Limits.disk)
            self.dir.mkdir(parents=True)
            mount_disk(self.dir, self.spec.limits.disk)
        else:
            log.warning("workspace %s: Limits(disk=None): it writes to the host's filesystem without bound", self.id)
        for sub in ("upper", "work", "root") if upper else ("work", "root"):
            (self.dir / sub).mkdir(parents=True)
            if self.spec.security.userns and sub != "root":
                _userns.chown_root(self.dir / sub)
        (self.dir / "owner").write_text(_kernel.owner_token(os.getpid()))

    def create_cgroup(self) -> None:
        self.cgroup = Cgroup.create(f"ws-{self.id}", self.spec.limits, self.spec.security.device_rules())

    async def spawn(self) -> None:
        """Start bunshin-init over ``lower`` (set by ``start``, or a snapshot's chain for a filesystem-only copy)."""
        assert self.cgroup is not None and self.lower is not None
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "BUNSHIN_WORKDIR": self.spec.workdir,
            "BUNSHIN_AGENT_THREADS": str(agent_threads(self.spec.limits.pids)),
        }
        argv = [
            str(_paths.init_binary()),
            "--lower", self.lower,
            "--upper", str(self.dir / "upper"),
            "--work", str(self.dir / "work"),
            "--root", str(self.dir / "root"),
            "--hostname", self.spec.hostname,
            "--agent", f"{AGENT_DIR}/bunshin-agent",
            "--workdir", self.spec.workdir,
            "--self", f"{AGENT_DIR}/bunshin-init",
        ]  # fmt: skip
        for procs in self.cgroup.procs_files:
            argv += ["--cgroup", procs]
        argv += self.spec.security.init_args(nofile=self.spec.limits.nofile, mknod=_mknod_allowed(self.spec.security))
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        self.shim = await anyio.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert self.shim.stdout is not None
        status = BufferedByteReceiveStream(self.shim.stdout)
        ready = joined = False
        with anyio.fail_after(START_TIMEOUT):
            while not (ready and joined):
                try:
                    line = (await status.receive_until(b"\n", 4096)).decode(errors="replace")
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    raise WorkspaceStartError(
                        f"workspace {self.id}: init exited before it was ready", workspace_id=self.id
                    ) from None
                if line.startswith("P "):
                    self.pid = int(line[2:])
                    try:
                        self.pidfd = os.pidfd_open(self.pid)
                    except ProcessLookupError:  # pid 1 failed already (a static init fails fast): "E" follows
                        pass
                elif line.startswith("R"):
                    ready = True
                elif line.startswith("J"):  # pid 1 and the agent are in the workspace's cgroups
                    joined = True
                elif line.startswith("E "):
                    raise WorkspaceStartError(f"workspace {self.id}: {line[2:]}", workspace_id=self.id)
        await self.shim.stdout.aclose()
        if self.pid is None or self.pidfd is None:
            raise WorkspaceStartError(f"workspace {self.id}: pid 1 exited while it started", workspace_id=self.id)
        self.client = AgentClient(self.pid, self.pidfd, self.id, procs=self.procs_file)

    async def adopt(self, pid: int) -> None:
        """Take a pid 1 that CRIU restored (our child through rst_sibling) as this workspace's; a client kept by
        ``stop_processes(keep_client=True)`` talks to it from now on."""
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        if self.client is not None:
            await self.client.rebind(pid, self.pidfd)
        else:
            self.client = AgentClient(pid, self.pidfd, self.id, procs=self.procs_file)

    async def stop_processes(self, *, kill_shim: bool = False, keep_client: bool = False) -> None:
        """Kill the tree and reap its pid 1 (or shim), leaving directory and cgroup in place. ``kill_shim``: a
        start that failed before pid 1 reported itself kills the shim itself. ``keep_client``: the agent client
        stays, with the calls it holds, for the pid 1 ``adopt`` takes next."""
        if self.client is not None and not keep_client:
            await self.client.aclose()
            self.client = None
        elif self.client is not None:  # its pid-cursor ledger borrows the pidfd closed below: ``adopt`` hands it on
            self.client.pids.close()
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self.shim is None:  # restored by CRIU: pid 1 is our own child (rst_sibling), reap it
                await reap_pid1(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None
        if self.shim is not None:
            if kill_shim and self.shim.returncode is None and self.pid is None:
                self.shim.kill()
            await self.shim.wait()
            await self.shim.aclose()
            self.shim = None
        self.pid = None

    async def aclose(self) -> None:
        """Stop every process and remove mounts, cgroup and directories. Idempotent; shielded, with a deadline."""
        if self.state == "closed":
            return
        self.state = "closed"
        with anyio.CancelScope(shield=True):
            await self.teardown()

    async def teardown(self) -> None:
        pid = self.pid
        with anyio.move_on_after(CLOSE_TIMEOUT):
            await self.stop_processes(kill_shim=True)
            if self.cgroup is not None:
                await self.cgroup.destroy()
            if self.dir.exists():
                await anyio.to_thread.run_sync(unmount_disk, self.dir)
                await anyio.to_thread.run_sync(_tree.discard, self.dir)
        self.pid = pid  # a closed workspace still names the pid it had (``repr``)
        if self.lower is not None:  # after the overlay on them is gone (pid 1 reaped), even past the deadline
            await anyio.to_thread.run_sync(release_layers, chain_layers(self.lower), self.id)
        await anyio.to_thread.run_sync(self.map_from, None)

    def map_from(self, snap_dir: Path | None) -> None:
        """Make ``snap_dir`` the snapshot this workspace's memory is mapped from (``None``: private memory): it is
        held while the workspace lives, so that dumps can be incremental on its images (blocking). Its processes
        are gone or not yet there, so the old one is let go first, and so is the tracking of their writes."""
        self.tracking.drop()
        if self.mem_parent is not None:
            release_layers([self.mem_parent], self.id)
            self.mem_parent = None
        if snap_dir is not None:
            hold_layers([snap_dir], self.id)
            self.mem_parent = snap_dir

    # ------------------------------------------------------------------------------------------------ agent

    def procs_file(self) -> str | None:
        """Its cgroup's procs file (every process of the workspace), if it has a cgroup."""
        return self.cgroup.procs_files[0] if self.cgroup is not None and self.cgroup.procs_files else None

    def abandon_calls(self) -> None:
        """This workspace is about to be closed: its calls cancelled from now on need not wait for the agent to
        reap their commands (``AgentClient.abandon``)."""
        if self.client is not None:
            self.client.abandon()

    def live_client(self) -> AgentClient:
        if self.state != "running" or self.client is None:
            raise self.closed_error()
        return self.client

    async def call(self, req: P.Request, tool: str, timeout: float | None = None) -> P.Response:
        resp = await self.live_client().request(req)
        if isinstance(resp, P.Failure):
            _raise_failure(resp, tool, timeout, self.id)
        return resp

    async def start_step(self, step: SetupStep) -> int:
        """Send a recorded spawn; returns its in-workspace pid."""
        resp = await self.call(step.request(), "spawn")
        assert isinstance(resp, P.Spawned)
        # No await between the answer and the record: a snapshot's drain cannot see one without the other.
        self.setup.append((step, resp.pid))
        return resp.pid
