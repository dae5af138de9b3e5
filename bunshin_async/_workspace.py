"""``Workspace``: an isolated, persistent Linux workspace driven from asyncio (local backend, no daemon).

Each workspace is a process tree in its own mount, pid, ipc, uts and network namespaces (loopback only), rooted in
an overlayfs (read-only image + agent layer + a private upper dir), with its own devpts, in a cgroup with memory,
pids and CPU limits, behind the security boundary of ``Security`` (``_security``: reduced capabilities,
no_new_privs, seccomp, masked /proc, a device allow-list). ``bunshin-init`` (native/init.c) builds all that and
starts the agent, which serves tool calls on a Unix socket that the host reaches through ``/proc/<pid 1>/root``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from . import _fork, _gc, _gui, _paths, _security
from . import _protocol as P
from ._client import AgentClient
from ._compat import BaseExceptionGroup
from ._exceptions import (
    AgentError,
    CapabilityMissing,
    FileNotFound,
    ForkError,
    ImageError,
    InvalidArgument,
    PathOutsideWorkspace,
    ToolError,
    ToolTimeout,
    WorkspaceClosed,
    WorkspaceStartError,
)
from ._image import AGENT_DIR, Image, agent_layer
from ._kernel import Cgroup, Limits, devices_controller, mount_disk, unmount_disk
from ._protocol import DirEntry, ExecResult
from ._security import Security

__all__ = ["BackgroundProcess", "Shell", "Workspace"]

START_TIMEOUT = 30.0
CLOSE_TIMEOUT = 10.0


def _raise_failure(resp: P.Failure, tool: str, timeout: float | None, workspace_id: str) -> None:
    if resp.error == "timeout":
        raise ToolTimeout(resp.message, tool=tool, timeout=timeout or 0.0, stdout=resp.stdout, stderr=resp.stderr)
    if resp.error == "path_outside":
        raise PathOutsideWorkspace(resp.message, tool=tool, path=resp.path or "")
    if resp.error == "not_found":
        raise FileNotFound(resp.message, tool=tool, path=resp.path or "")
    if resp.error == "invalid":
        raise InvalidArgument(resp.message, tool=tool)
    if resp.error == "os":
        raise ToolError(resp.message, tool=tool)
    raise AgentError(f"{tool}: {resp.message}", workspace_id=workspace_id)


def _check_timeout(timeout: float | None, tool: str) -> None:
    if timeout is not None and not timeout > 0:
        raise InvalidArgument(f"timeout must be positive, not {timeout!r}", tool=tool)


def _argv_or_command(cmd: str | Sequence[str], tool: str) -> dict[str, object]:
    if isinstance(cmd, str):
        return {"command": cmd}
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidArgument(f"command must be a string or a non-empty list of strings, not {cmd!r}", tool=tool)
    return {"argv": argv}


DEFAULT_WORKDIR = "/workspace"
MOUNT_OPTIONS_MAX = 3600
"""What the image's layers may take of the overlay's options: mount(2) copies one page of them (4096 bytes), which
also hold the agent layer, upper and work dirs (and a fork's snapshot layers)."""


def _default_workdir(image_workdir: str | None) -> str:
    """The image's WorkingDir when it names a directory below / (normalized), else /workspace: confining the file
    tools to / would confine them to nothing."""
    if image_workdir and image_workdir.startswith("/"):
        wd = os.path.normpath(image_workdir)
        if wd != "/" and not wd.startswith("//"):
            return wd
    return DEFAULT_WORKDIR


def _mknod_allowed(security: Security) -> bool:
    """MKNOD is kept only where the device allow-list is enforced (or there is none to enforce)."""
    if security.device_rules() is None or devices_controller():
        return True
    _security.log.warning("no cgroup v1 devices controller: MKNOD is dropped instead of a device allow-list")
    return False


class Workspace:
    """An isolated, persistent workspace. Use as ``async with Workspace() as ws:``.

    ``image`` defaults to the cached Debian base image; a string names an image in the layer store
    (``Image.load``). ``workdir`` is where commands start and the directory the file tools are confined to: by
    default the image's WorkingDir when its config sets one other than ``/``, else ``/workspace``. An image's Env
    is the base of ``env`` (``env`` wins). ``max_output`` caps each of stdout and stderr per call (bytes); the rest
    is read and dropped and the result says ``truncated``. ``display`` (a ``Display``, or True for 1024x768x24)
    starts a virtual X display in the workspace, sets ``DISPLAY`` for every command and enables ``ws.gui``;
    ``image`` then defaults to the GUI image. ``user`` (``NAME``, ``UID``, or either with
    ``:GROUP``/``:GID``, resolved from the image's /etc/passwd and /etc/group) is who commands, background
    processes and shells run as unless a call names its own; None is the image's User (its config), else root.
    The file tools always act as root.
    ``security`` is the boundary (``Security``: on by default; its fields name the relaxations), kept by every
    fork.
    """

    def __init__(
        self,
        image: Image | str | None = None,
        *,
        limits: Limits | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        hostname: str = "bunshin",
        max_output: int = P.DEFAULT_MAX_OUTPUT,
        display: _gui.Display | bool | None = None,
        user: str | None = None,
        security: Security | None = None,
    ) -> None:
        if isinstance(image, str):
            image = Image.load(image)
        config = image.config if image is not None else None
        if workdir is None:
            workdir = _default_workdir(config.working_dir if config else None)
        if not workdir.startswith("/") or os.path.normpath(workdir) != workdir or workdir == "/":
            raise ValueError(f"workdir must be a normalized absolute path below /, not {workdir!r}")
        self._image = image
        self.limits = limits or Limits()
        self.security = security or Security()
        self.workdir = workdir
        self.env = {**(config.env if config else {}), **(env or {})}
        self.hostname = hostname
        self.max_output = max_output
        self.user = user if user is not None else (config.user if config else None)
        self.display = _gui.Display() if display is True else (display or None)
        """The display this workspace starts (None for a copy restored from a snapshot: it has its parent's)."""
        if self.display is not None:
            self.env["DISPLAY"] = _gui.DISPLAY
        self._gui: _gui.Gui | None = None
        self.id = secrets.token_hex(6)
        self.pid: int | None = None  # host pid of the workspace's pid 1
        self._dir = _paths.workspaces_dir() / self.id
        self._cgroup: Cgroup | None = None
        self._shim: Process | None = None
        self._pidfd: int | None = None
        self._client: AgentClient | None = None
        self._lower: str | None = None  # overlay lowerdir chain: snapshot layers (forks), agent layer, image
        self._mem_parent: Path | None = None  # snapshot dir a CoW copy's memory is mapped from (held while alive)
        self._state = "new"  # new -> running -> closed
        self._setup: list[tuple[_fork.SetupStep, int]] = []  # every spawn() in order, with its in-workspace pid
        self.restarted_processes: list[BackgroundProcess] = []
        """For a filesystem-only copy (``fork_mode == "fs"``): the recorded processes started again in it, in
        order, each with its ``step``; they did not carry their memory. Empty otherwise."""

    # ------------------------------------------------------------------------------------------------ lifecycle

    @property
    def image(self) -> Image:
        if self._image is None:
            self._image = Image.gui() if self.display is not None else Image.base()
        return self._image

    @property
    def gui(self) -> _gui.Gui:
        """The GUI tools (screenshot, click, type_text, key, ...); they raise ``DisplayError`` without a display."""
        if self._gui is None:
            self._gui = _gui.Gui(self)
        return self._gui

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    @property
    def directory(self) -> Path:
        """Host directory of this workspace (``upper`` holds its changes to the image)."""
        return self._dir

    @property
    def cgroup(self) -> Cgroup | None:
        return self._cgroup

    async def __aenter__(self) -> Workspace:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Create the workspace. On any failure (cancellation included) everything made so far is removed."""
        if self._state != "new":
            raise WorkspaceClosed(f"workspace {self.id} was already started", workspace_id=self.id)
        self._state = "starting"
        init = _paths.init_binary()
        if not init.exists():
            raise CapabilityMissing(
                f"{init} is missing", capability="bunshin-init", remedy="reinstall bunshin (`make setup`)"
            )
        if os.geteuid() != 0:
            raise CapabilityMissing(
                "workspaces need root (namespaces, mounts, cgroups)", capability="root", remedy="run as root"
            )
        image = self.image
        if len(image.lower_dirs) + 2 * len(str(self._dir)) > MOUNT_OPTIONS_MAX:
            raise ImageError(
                f"image {image.name!r} has too many layers ({len(image.layers)}) for one overlay mount's options "
                f"({MOUNT_OPTIONS_MAX} bytes); squash some of its layers",
                image=image.name,
            )
        try:
            _fork._prime_attach()  # the shim's cgroup attach then waits no grace period: the agent is ready sooner
            layer = await anyio.to_thread.run_sync(agent_layer)
            self._make_dirs()
            self.security.log_relaxations(self.id)
            self._cgroup = Cgroup.create(f"ws-{self.id}", self.limits, self.security.device_rules())
            self._lower = f"{layer}:{image.lower_dirs}"
            await self._spawn()
            self._state = "running"
            if self.display is not None:
                await _gui.start_display(self, self.display)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._teardown()
            self._state = "closed"
            raise

    def _make_dirs(self, upper: bool = True) -> None:
        """The workspace's host directory, with an ``owner`` file (our pid and start time) for ``bunshin gc``.
        A restored copy makes its upper dir itself (``upper=False``)."""
        if self.limits.disk is not None:  # the upper and work dirs on a tmpfs of that size (Limits.disk)
            self._dir.mkdir(parents=True)
            mount_disk(self._dir, self.limits.disk)
        for sub in ("upper", "work", "root") if upper else ("work", "root"):
            (self._dir / sub).mkdir(parents=True)
        (self._dir / "owner").write_text(_gc.owner_token(os.getpid()))

    async def _spawn(self) -> None:
        """Start bunshin-init over ``_lower`` (set by ``start``, or a snapshot's chain for a filesystem-only copy)."""
        assert self._cgroup is not None and self._lower is not None
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "BUNSHIN_WORKDIR": self.workdir}
        argv = [
            str(_paths.init_binary()),
            "--lower", self._lower,
            "--upper", str(self._dir / "upper"),
            "--work", str(self._dir / "work"),
            "--root", str(self._dir / "root"),
            "--hostname", self.hostname,
            "--agent", f"{AGENT_DIR}/bunshin-agent",
            "--workdir", self.workdir,
            "--self", f"{AGENT_DIR}/bunshin-init",
        ]  # fmt: skip
        for procs in self._cgroup.procs_files:
            argv += ["--cgroup", procs]
        argv += self.security.init_args(nofile=self.limits.nofile, mknod=_mknod_allowed(self.security))
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        self._shim = await anyio.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert self._shim.stdout is not None
        status = BufferedByteReceiveStream(self._shim.stdout)
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
                        self._pidfd = os.pidfd_open(self.pid)
                    except ProcessLookupError:  # pid 1 failed already (a static init fails fast): "E" follows
                        pass
                elif line.startswith("R"):
                    ready = True
                elif line.startswith("J"):  # pid 1 and the agent are in the workspace's cgroups
                    joined = True
                elif line.startswith("E "):
                    raise WorkspaceStartError(f"workspace {self.id}: {line[2:]}", workspace_id=self.id)
        await self._shim.stdout.aclose()
        self._client = AgentClient(f"/proc/{self.pid}/root/run/bunshin/agent.sock", self.id)

    async def aclose(self) -> None:
        """Stop every process of the workspace and remove its mounts, cgroup and directories. Idempotent; safe
        under cancellation (the cleanup is shielded, with a deadline)."""
        if self._state == "closed":
            return
        self._state = "closed"
        with anyio.CancelScope(shield=True):
            await self._teardown()

    async def _teardown(self) -> None:
        with anyio.move_on_after(CLOSE_TIMEOUT):
            if self._client is not None:
                await self._client.aclose()
            if self._pidfd is not None:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if self._shim is None:  # restored by CRIU: pid 1 is our own child (rst_sibling), reap it
                    await _fork.reap_pid1(self._pidfd)
                os.close(self._pidfd)
                self._pidfd = None
            if self._shim is not None:
                if self._shim.returncode is None and self.pid is None:
                    self._shim.kill()
                await self._shim.wait()
                await self._shim.aclose()
            if self._cgroup is not None:
                await self._cgroup.destroy()
            if self._dir.exists():
                await anyio.to_thread.run_sync(unmount_disk, self._dir)
                await anyio.to_thread.run_sync(shutil.rmtree, self._dir, True)
        if self._lower is not None:  # after the overlay on them is gone (pid 1 reaped), even past the deadline
            await anyio.to_thread.run_sync(_fork.release_layers, _fork.chain_layers(self._lower), self.id)
        await anyio.to_thread.run_sync(_fork._map_from, self, None)

    # ------------------------------------------------------------------------------------------------ fork

    fork_mode: str = "fresh"
    """``"fresh"`` for a workspace started cold, ``"criu"`` (or ``"criu-cow"``, ``"criu-ksm"``) for one restored
    from a CRIU snapshot (fork, rollback), ``"fs"`` for a filesystem-only copy: files carried, the recorded
    processes restarted (``restarted_processes``), no memory carried (``_fork`` module doc)."""
    restore_ms: float | None = None

    @property
    def setup(self) -> list[_fork.SetupStep]:
        """Every ``spawn`` of this workspace (a copy: those its snapshot recorded, then its own), in order: what a
        filesystem-only copy starts again."""
        return [step for step, _pid in self._setup]

    async def snapshot(self) -> _fork.Snapshot:
        """Checkpoint the live workspace (processes and files) without stopping it. Waits for tool calls in flight
        to finish and holds new ones for the duration. The caller owns the snapshot (``aclose()`` it). Without a
        usable CRIU (or with ``BUNSHIN_FORK_MODE=fs``) it holds files and the recorded setup only (``snap.mode``)."""
        return await _fork.snapshot(self)

    @classmethod
    async def from_snapshot(cls, snap: _fork.Snapshot, n: int = 1) -> list[Workspace]:
        """``n`` new live workspaces, each a copy of ``snap`` with its own namespaces, cgroup and files. All or
        nothing: if one copy fails the others are closed and ``ForkError`` raised. Warm spares of the snapshot
        (``snap.keep_spares(k)``) are handed out first, thawed; the rest are restored now."""
        if n < 1:
            raise ValueError("n must be at least 1")
        if snap.closed:
            raise ForkError(f"snapshot {snap.id} is closed", workspace_id=snap.workspace_id)
        spares = snap._spares.take(n) if snap._spares is not None else []
        if len(spares) == n:
            return spares
        try:
            return spares + await cls._restore_many(snap, n - len(spares))
        except BaseException:
            with anyio.CancelScope(shield=True):
                for ws in spares:
                    await ws.aclose()
            raise

    @classmethod
    async def _restore_many(cls, snap: _fork.Snapshot, n: int) -> list[Workspace]:
        copies = [cls._for_restore(snap) for _ in range(n)]
        try:
            async with anyio.create_task_group() as tg:
                for ws in copies:
                    tg.start_soon(_fork.restore_into, ws, snap)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                for ws in copies:
                    await ws.aclose()
            fork_errors = [e for e in getattr(exc, "exceptions", [exc]) if isinstance(e, ForkError)]
            if fork_errors and isinstance(exc, BaseExceptionGroup):
                raise fork_errors[0] from exc
            raise
        return copies

    async def fork(self, n: int = 1) -> list[Workspace]:
        """``n`` live copies of this workspace as it is now (see ``snapshot``); this one keeps running. Close each
        copy with ``aclose()``. Concurrent forks of one workspace share one snapshot where they can."""
        return await _fork.fork(self, n)

    async def rollback(self, snap: _fork.Snapshot) -> None:
        """Replace this workspace's processes and files by the snapshot's; the object keeps its id. If the restore
        fails the workspace is closed and ``ForkError`` raised."""
        await _fork.rollback(self, snap)

    @classmethod
    def _for_restore(cls, snap: _fork.Snapshot) -> Workspace:
        """A not-yet-started workspace that adopts a restored tree (``_fork.restore_into``)."""
        return cls(
            snap.image,
            limits=snap.limits,
            workdir=snap.workdir,
            env=snap.env,
            hostname=snap.hostname,
            max_output=snap.max_output,
            user=snap.user,
            security=snap.security,
        )

    def _live_client(self) -> AgentClient:
        if self._state != "running" or self._client is None:
            raise WorkspaceClosed(f"workspace {self.id} is {self._state}", workspace_id=self.id)
        return self._client

    async def _call(self, req: P.Request, tool: str, timeout: float | None = None) -> P.Response:
        resp = await self._live_client().request(req)
        if isinstance(resp, P.Failure):
            _raise_failure(resp, tool, timeout, self.id)
        return resp

    # ------------------------------------------------------------------------------------------------ tools

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run a command to completion. A string runs through bash (/bin/sh where the image has no bash;
        ``result.shell`` says which); a list is an argv. A non-zero exit is a result, not an error. Raises
        ``ToolTimeout`` (partial output attached) past ``timeout`` seconds. ``user`` overrides the workspace's."""
        _check_timeout(timeout, "exec")
        req = P.Exec(
            **_argv_or_command(cmd, "exec"),  # type: ignore[arg-type]
            cwd=cwd,
            env={**self.env, **(env or {})} or None,
            stdin=stdin.encode() if isinstance(stdin, str) else stdin,
            timeout=timeout,
            max_output=self.max_output,
            user=user if user is not None else self.user,
        )
        resp = await self._call(req, "exec", timeout)
        assert isinstance(resp, ExecResult)
        return resp

    def shell(self, *, cwd: str | None = None, env: Mapping[str, str] | None = None, user: str | None = None) -> Shell:
        """A persistent bash session, or /bin/sh where the image has no bash (``async with ws.shell() as sh: await
        sh.run("cd src")``; ``sh.path`` says which once open). ``user`` overrides the workspace's."""
        return Shell(self, cwd=cwd, env={**self.env, **(env or {})}, user=user if user is not None else self.user)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        resp = await self._call(P.ReadFile(path=path, max_bytes=max_bytes), "read_file")
        assert isinstance(resp, P.FileData)
        return resp.data

    async def read_text(self, path: str) -> str:
        return (await self.read_file(path)).decode("utf-8", "replace")

    async def write_file(self, path: str, data: bytes | str, *, append: bool = False, mode: int | None = None) -> None:
        raw = data.encode() if isinstance(data, str) else data
        await self._call(P.WriteFile(path=path, data=raw, append=append, mode=mode), "write_file")

    async def list_dir(self, path: str = ".") -> list[DirEntry]:
        resp = await self._call(P.ListDir(path=path), "list_dir")
        assert isinstance(resp, P.DirListing)
        return resp.entries

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._call(P.Remove(path=path, recursive=recursive), "remove")

    async def spawn(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        user: str | None = None,
    ) -> BackgroundProcess:
        """Start a process that keeps running between calls; output goes to ``log_path`` (in the workspace
        directory) or is dropped. It is recorded (``setup``): a filesystem-only copy starts it again. ``user``
        overrides the workspace's."""
        step = _fork.SetupStep(
            **_argv_or_command(cmd, "spawn"),  # type: ignore[arg-type]
            cwd=cwd,
            env={**self.env, **(env or {})} or None,
            log_path=log_path,
            user=user if user is not None else self.user,
        )
        return await self._start_step(step)

    async def _start_step(self, step: _fork.SetupStep) -> BackgroundProcess:
        resp = await self._call(step.request(), "spawn")
        assert isinstance(resp, P.Spawned)
        # No await between the answer and the record: a snapshot's drain cannot see one without the other.
        self._setup.append((step, resp.pid))
        return BackgroundProcess(self, resp.pid, step)

    async def start_entrypoint(
        self,
        args: Sequence[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
    ) -> BackgroundProcess:
        """Start the image's Entrypoint (with ``args``, else the image's Cmd; Cmd alone when there is no
        Entrypoint) as a background process, as ``docker run`` would, in the workspace directory. Raises
        ``InvalidArgument`` when the image names neither."""
        config = self.image.config
        argv = [*config.entrypoint, *(config.cmd if args is None else args)]
        if not argv:
            raise InvalidArgument(f"image {self.image.name!r} has no Entrypoint or Cmd to start", tool="spawn")
        return await self.spawn(argv, env=env, log_path=log_path)

    async def ping(self) -> int:
        """Round-trip to the agent; returns its pid inside the workspace."""
        return (await self.agent_info()).pid

    async def agent_info(self) -> P.Pong:
        """The agent's answer to a ping: protocol version, pid and the shell command strings run through
        (``/bin/bash``, ``/bin/sh``, or None when the image has neither)."""
        resp = await self._call(P.Ping(), "ping")
        assert isinstance(resp, P.Pong)
        return resp

    def __repr__(self) -> str:
        return f"<Workspace {self.id} {self._state} pid={self.pid}>"


class BackgroundProcess:
    """A process started with ``Workspace.spawn``; ``pid`` is its pid inside the workspace, ``step`` how it was
    started."""

    def __init__(self, workspace: Workspace, pid: int, step: _fork.SetupStep | None = None) -> None:
        self.workspace = workspace
        self.pid = pid
        self.step = step

    async def poll(self) -> int | None:
        """Exit code, or None while it runs."""
        resp = await self.workspace._call(P.Poll(pid=self.pid), "poll")
        assert isinstance(resp, P.PollResult)
        return resp.returncode

    async def signal(self, sig: int) -> None:
        await self.workspace._call(P.Signal(pid=self.pid, signal=int(sig)), "signal")

    async def kill(self) -> None:
        await self.signal(signal.SIGKILL)


class Shell:
    """A persistent bash session inside a workspace: cwd, exported and plain shell variables survive between
    ``run`` calls. A timed-out command is killed with its children; the session itself survives."""

    def __init__(
        self, workspace: Workspace, *, cwd: str | None, env: Mapping[str, str], user: str | None = None
    ) -> None:
        self.workspace = workspace
        self._open_args = P.ShellOpen(cwd=cwd, env=dict(env) or None, user=user)
        self._id: int | None = None
        self.path: str | None = None
        """The shell the session runs (/bin/bash, or /bin/sh where the image has no bash), once open."""

    async def __aenter__(self) -> Shell:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        resp = await self.workspace._call(self._open_args, "shell")
        assert isinstance(resp, P.ShellOpened)
        self._id = resp.shell_id
        self.path = resp.shell

    async def run(self, command: str, *, timeout: float | None = None) -> ExecResult:
        if self._id is None:
            raise InvalidArgument("the shell session is not open", tool="shell")
        _check_timeout(timeout, "shell")
        req = P.ShellRun(shell_id=self._id, command=command, timeout=timeout, max_output=self.workspace.max_output)
        resp = await self.workspace._call(req, "shell", timeout)
        assert isinstance(resp, ExecResult)
        return resp

    async def aclose(self) -> None:
        if self._id is None:
            return
        shell_id, self._id = self._id, None
        if not self.workspace.closed:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                try:
                    await self.workspace._call(P.ShellClose(shell_id=shell_id), "shell")
                except WorkspaceClosed:
                    pass
