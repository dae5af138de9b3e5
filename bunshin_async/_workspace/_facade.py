"""``Workspace``: an isolated, persistent Linux workspace driven from asyncio (local backend, no daemon).

Each workspace is a process tree in its own mount, pid, ipc, uts and network namespaces (loopback only), rooted in
an overlayfs (read-only image + agent layer + a private upper dir), with its own devpts, in a cgroup with memory,
pids and CPU limits, behind the security boundary of ``Security`` (``_security``: reduced capabilities,
no_new_privs, seccomp, masked /proc, a device allow-list). ``bunshin-init`` (native/init.c) builds all that and
starts the agent, which serves tool calls on a Unix socket that the host reaches below ``/proc/<pid 1>/root``
without following any name the workspace controls (``_client``).
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from .._exceptions import DisplayError, InvalidArgument, InvalidValue, ToolTimeout, WorkspaceClosed
from .._fork import _dump, _restore
from .._fork._snapshot import Snapshot, record_of
from .._host import _protocol as P
from .._host._kernel import CgroupView, Limits
from .._host._pidcursor import ReadPids
from .._host._protocol import DirEntry, ExecResult
from .._host._security import Security
from .._images._image import Image
from . import _gc, _gui
from ._core import SetupStep, WorkspaceCore, WorkspaceSpec

__all__ = [
    "BackgroundProcess",
    "Shell",
    "Workspace",
    "abandon_calls",
    "adopt_pids",
    "continue_pids",
    "in_place",
    "mark_pids",
    "pid_cursor",
    "pids_since_mark",
]


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
T = TypeVar("T")


def _default_workdir(image_workdir: str | None) -> str:
    """The image's WorkingDir when it names a directory below / (normalized), else /workspace: confining the file
    tools to / would confine them to nothing."""
    if image_workdir and image_workdir.startswith("/"):
        wd = os.path.normpath(image_workdir)
        if wd != "/" and not wd.startswith("//"):
            return wd
    return DEFAULT_WORKDIR


class _OnCore(Generic[T]):
    """A ``Workspace`` attribute held by its core (``spec``: by the core's ``WorkspaceSpec``, which setting it
    replaces): the facade keeps no state of its own."""

    def __init__(self, spec: bool = False) -> None:
        self.spec = spec

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, ws: Any, owner: type | None = None) -> T:
        if ws is None:  # on the class (help(), docs): the descriptor itself
            return self  # type: ignore[return-value]
        return getattr(ws._core.spec if self.spec else ws._core, self.name)  # type: ignore[no-any-return]

    def __set__(self, ws: Any, value: T) -> None:
        if self.spec:
            ws._core.spec = msgspec.structs.replace(ws._core.spec, **{self.name: value})
        else:
            setattr(ws._core, self.name, value)


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
            raise InvalidValue(
                f"workdir must be a normalized absolute path below /, not {workdir!r}", argument="workdir"
            )
        spec = WorkspaceSpec(
            image,
            limits=limits or Limits(),
            security=security or Security(),
            workdir=workdir,
            env={**(config.env if config else {}), **(env or {})},
            hostname=hostname,
            max_output=max_output,
            user=user if user is not None else (config.user if config else None),
        )
        self._core = WorkspaceCore(spec)
        self.display = _gui.Display() if display is True else (display or None)
        """The display this workspace starts (None for a copy restored from a snapshot: it has its parent's)."""
        if self.display is not None:
            self.env["DISPLAY"] = _gui.DISPLAY
        self._gui: _gui.Gui | None = None

    id: _OnCore[str] = _OnCore()
    pid: _OnCore[int | None] = _OnCore()
    """Host pid of the workspace's pid 1."""
    limits: _OnCore[Limits] = _OnCore(spec=True)
    security: _OnCore[Security] = _OnCore(spec=True)
    workdir: _OnCore[str] = _OnCore(spec=True)
    env: _OnCore[dict[str, str]] = _OnCore(spec=True)
    hostname: _OnCore[str] = _OnCore(spec=True)
    max_output: _OnCore[int] = _OnCore(spec=True)
    user: _OnCore[str | None] = _OnCore(spec=True)

    @classmethod
    def _facade(cls, core: WorkspaceCore) -> Workspace:
        """The workspace over a core the fork layer made (a copy: no display of its own, it has its parent's)."""
        ws = cls.__new__(cls)
        ws._core, ws.display, ws._gui = core, None, None
        return ws

    # ------------------------------------------------------------------------------------------------ lifecycle

    @property
    def image(self) -> Image:
        if self._core.spec.image is None:
            image = Image.gui() if self.display is not None else Image.base()
            self._core.spec = msgspec.structs.replace(self._core.spec, image=image)
        return self._core.spec.image  # type: ignore[return-value]  # set just above

    @property
    def gui(self) -> _gui.Gui:
        """The GUI tools (screenshot, click, type_text, key, ...); they raise ``DisplayError`` without a display."""
        if self._gui is None:
            self._gui = _gui.Gui(self._core)
        return self._gui

    @property
    def closed(self) -> bool:
        return self._core.state == "closed"

    @property
    def directory(self) -> Path:
        """Host directory of this workspace (``upper`` holds its changes to the image)."""
        return self._core.dir

    @property
    def cgroup(self) -> CgroupView | None:
        """The workspace's cgroup, read-only (its processes and counters), None before ``start`` and after
        ``aclose``."""
        cg = self._core.cgroup
        return None if cg is None else CgroupView(cg)

    async def __aenter__(self) -> Workspace:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Create the workspace. On any failure (cancellation included) everything made so far is removed. The
        process's first start also removes what processes that died without closing theirs left (``_gc.reclaim``)."""
        self.image  # noqa: B018 - resolves the default image into the core
        await _gc.reclaim()
        await self._core.start()
        if self.display is not None:
            async with self._core.failing_closes():
                await _start_display(self, self.display)

    async def aclose(self) -> None:
        """Stop every process of the workspace and remove its mounts, cgroup and directories. Idempotent; safe
        under cancellation (the cleanup is shielded, with a deadline)."""
        await self._core.aclose()

    # ------------------------------------------------------------------------------------------------ fork

    fork_mode: _OnCore[str] = _OnCore()
    """``"fresh"`` for a workspace started cold, ``"criu"`` (or ``"criu-cow"``, ``"criu-ksm"``) for one restored
    from a CRIU snapshot (fork, rollback), ``"fs"`` for a filesystem-only copy: files carried, the recorded
    processes restarted (``restarted_processes``), no memory carried (``_fork`` module doc)."""
    restore_ms: _OnCore[float | None] = _OnCore()

    @property
    def restarted_processes(self) -> list[BackgroundProcess]:
        """For a filesystem-only copy (``fork_mode == "fs"``): the recorded processes started again in it, in
        order, each with its ``step``; they did not carry their memory. Empty otherwise."""
        return [BackgroundProcess(self, pid, step) for step, pid in self._core.restarted]

    @property
    def setup(self) -> list[SetupStep]:
        """Every ``spawn`` of this workspace (a copy: those its snapshot recorded, then its own), in order: what a
        filesystem-only copy starts again."""
        return [step for step, _pid in self._core.setup]

    async def snapshot(self) -> Snapshot:
        """Checkpoint the live workspace (processes and files) without stopping it. Waits for tool calls in flight
        to finish and holds new ones for the duration. The caller owns the snapshot (``aclose()`` it). Without a
        usable CRIU (or with ``BUNSHIN_FORK_MODE=fs``) it holds files and the recorded setup only (``snap.mode``)."""
        return await _dump.snapshot(self._core)

    @classmethod
    async def from_snapshot(cls, snap: Snapshot, n: int = 1) -> list[Workspace]:
        """``n`` new live workspaces, each a copy of ``snap`` with its own namespaces, cgroup and files. All or
        nothing: if one copy fails the others are closed and ``ForkError`` raised. Warm spares of the snapshot
        (``snap.keep_spares(k)``) are handed out first, thawed; the rest are restored now."""
        return [cls._facade(core) for core in await _restore.copies(record_of(snap), n)]

    async def fork(self, n: int = 1) -> list[Workspace]:
        """``n`` live copies of this workspace as it is now (see ``snapshot``); this one keeps running. Close each
        copy with ``aclose()``. Concurrent forks of one workspace share one snapshot where they can."""
        return [type(self)._facade(core) for core in await _dump.fork(self._core, n)]

    async def rollback(self, snap: Snapshot) -> None:
        """Replace this workspace's processes and files by the snapshot's; the object keeps its id. If the restore
        fails the workspace is closed and ``ForkError`` raised."""
        await _restore.rollback(self._core, record_of(snap))

    async def _call(self, req: P.Request, tool: str, timeout: float | None = None) -> P.Response:
        return await self._core.call(req, tool, timeout)

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
        step = SetupStep(
            **_argv_or_command(cmd, "spawn"),  # type: ignore[arg-type]
            cwd=cwd,
            env={**self.env, **(env or {})} or None,
            log_path=log_path,
            user=user if user is not None else self.user,
        )

        return BackgroundProcess(self, await self._core.start_step(step), step)

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
        """The agent's answer to a ping: protocol version, pid, the shell command strings run through
        (``/bin/bash``, ``/bin/sh``, or None when the image has neither) and the calls ``waiting`` behind another
        command of their shell session."""
        resp = await self._call(P.Ping(), "ping")
        assert isinstance(resp, P.Pong)
        return resp

    def __repr__(self) -> str:
        return f"<Workspace {self.id} {self._core.state} pid={self.pid}>"


class BackgroundProcess:
    """A process started with ``Workspace.spawn``; ``pid`` is its pid inside the workspace, ``step`` how it was
    started."""

    def __init__(self, workspace: Workspace, pid: int, step: SetupStep | None = None) -> None:
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
    ``run`` calls. A timed-out command is killed with its children; the session itself survives. Calls run one at
    a time, in no set order: one cancelled while it waits for the session never runs."""

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


def in_place(ws: Workspace) -> AbstractAsyncContextManager[ReadPids]:
    """The scope of a speculative call run in ``ws``, not in a fork (the speculation runtime's reads): the pids its
    processes took are handed out again unless ``ReadPids.use`` says the rollout took its result, where that is
    provably what the plain loop sees (``_host/_pidcursor``). The runtime's, not a ``Workspace`` method: its
    ``ReadPids`` is no public type."""
    return ws._core.live_client().pids.read()


def abandon_calls(ws: Workspace) -> None:
    """``ws`` is about to be closed (a discarded speculative fork): a call of it cancelled from now on returns
    without waiting for the agent to reap its command, which the close's cgroup kill reaps with everything else.
    Never for a workspace that lives on (its next call could meet the command still exiting)."""
    ws._core.abandon_calls()


async def adopt_pids(ws: Workspace, span: tuple[int, int]) -> ReadPids | None:
    """A speculative read a sibling ran for ``ws`` (the tool cache's single flight), its processes' pids ``span``
    there (``ReadPids.span``): ``ws``'s scope of it, as if it had run in place here, or None where ``ws``'s pids
    would have been others (then it must run here: ``PidLedger.adopt``). Held while a snapshot quiesces ``ws``
    (``AgentClient.adopt_pids``)."""
    return await ws._core.live_client().adopt_pids(*span)


async def pid_cursor(ws: Workspace) -> int | None:
    """Where ``ws``'s own next process starts (its pid namespace's last pid, what in-place reads left settled);
    None when not known (``PidLedger.cursor``)."""
    client = ws._core.client
    return await client.gated(client.pids.cursor) if client is not None else None


async def mark_pids(ws: Workspace) -> None:
    """A call about to run in ``ws`` whose state a capture may keep (a tool cache's write, a write branch's fork):
    remember where its pids start, for ``pids_since_mark``."""
    client = ws._core.client
    if client is not None:
        await client.gated(client.pids.mark)


async def pids_since_mark(ws: Workspace) -> int | None:
    """The pids ``ws``'s processes took since ``mark_pids`` (None: not marked, or not known)."""
    client = ws._core.client
    return await client.gated(client.pids.since_mark) if client is not None else None


async def continue_pids(ws: Workspace, last: int) -> bool:
    """``ws``'s pid cursor set to ``last``: a workspace restored from a sibling's snapshot continues the rollout's
    own pid sequence, not the sibling's (``PidLedger.continue_at``). False where it could not be."""
    client = ws._core.client
    return await client.gated(lambda: client.pids.continue_at(last)) if client is not None else False


async def _start_display(ws: Workspace, spec: _gui.Display) -> None:
    """Start Xvfb in the running workspace ``ws`` and wait until it serves clients. Raises ``DisplayError`` (with
    the X server's log tail) if it exits or does not answer within ``_gui.START_TIMEOUT`` seconds. Part of
    ``Workspace.start`` (on the facade: it runs commands and a background process like any caller)."""
    # -noreset: the server would otherwise reset (dropping its state) each time its last client disconnects, which
    # every screenshot does. -nolisten tcp: only the Unix sockets, which are the workspace's own.
    xvfb = shlex.join(
        [
            "Xvfb",
            _gui.DISPLAY,
            "-screen",
            "0",
            f"{spec.width}x{spec.height}x{spec.depth}",
            "-nolisten",
            "tcp",
            "-noreset",
        ]
    )
    missing = await ws.exec(["sh", "-c", "for p in Xvfb xdotool python3; do command -v $p >/dev/null || echo $p; done"])
    if missing.stdout.strip():
        raise DisplayError(
            f"workspace {ws.id}: the image {ws.image.name!r} lacks {' and '.join(missing.stdout.split())}; "
            "use the GUI image (`Image.gui()`, built by `bunshin image build --gui`)",
            workspace_id=ws.id,
            detail=missing.stdout,
        )
    proc = await ws.spawn(["/bin/sh", "-c", f"exec {xvfb} >{_gui.XVFB_LOG} 2>&1"])
    deadline = time.monotonic() + _gui.START_TIMEOUT
    delay = 0.01
    while True:
        try:
            probe = await ws.exec(["xdotool", "getdisplaygeometry"], env={"DISPLAY": _gui.DISPLAY}, timeout=5)
        except ToolTimeout as exc:  # a server that accepts but does not answer yet
            probe = ExecResult(exit_code=-1, stdout="", stderr=exc.stderr, duration=5.0)
        if probe.exit_code == 0:
            return
        code = await proc.poll()
        if code is not None or time.monotonic() > deadline:
            log = await ws.exec(["tail", "-c", "2000", _gui.XVFB_LOG])
            detail = (log.stdout or probe.stderr).strip()
            why = f"exited with status {code}" if code is not None else f"did not answer within {_gui.START_TIMEOUT} s"
            raise DisplayError(
                f"workspace {ws.id}: the X server (Xvfb {spec.width}x{spec.height}x{spec.depth}) {why}; "
                f"is the GUI image in use (`Image.gui()`, `bunshin image build --gui`)? {detail[-500:]}",
                workspace_id=ws.id,
                detail=detail,
            )
        await anyio.sleep(delay)
        delay = min(delay * 2, 0.1)
