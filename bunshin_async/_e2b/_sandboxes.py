"""The sandboxes of an E2B server: one Bunshin workspace each (on this host or a cluster's: ``_backends``), with
E2B's lifecycle around it.

A sandbox lives until its timeout (E2B's ``timeout``, reset by ``set_timeout`` and ``connect``), ``kill``, or the
server's end; a reaper task closes expired ones, so a client that disappears leaves nothing behind once its timeout
passes. ``pause`` keeps a snapshot (processes, memory and files) and closes the workspace; ``connect`` restores it.
``fork(count)`` is a live ``Workspace.fork`` (on a cluster, past the parent host's free slots, copies of a snapshot
placed by the cluster's cost model); ``create_snapshot`` keeps a ``Snapshot`` that ``create`` accepts as a template
id. Commands started through envd are tracked here (``Process``) because a fork or a resume carries them.
"""

from __future__ import annotations

import datetime
import math
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from .._exceptions import BunshinError
from .._images._docker import is_reference
from .._images._image import Image
from ._backends import Backend, Handle, LocalBackend, Snap
from ._templates import Build
from ._wire import ENVD_VERSION, ApiError, NewSandbox, RpcError, SandboxOut, SnapshotOut

DEFAULT_TEMPLATE = "base"
"""The SDK's default template id; it means Bunshin's default image."""
IMAGE_METADATA_KEYS = ("bunshin.image", "image")
"""Metadata keys that name the image when the template is the default one (gateways that pick images from metadata)."""
CONTROL_DIR = "/run/e2b"
"""Where each workspace keeps the files of envd's commands (the file tools' confinement root; see ``_envd``)."""
HOME = "/home/user"
"""E2B's home directory: where commands start unless the request or the image says otherwise."""
MAX_TIMEOUT = 24 * 3600
PAUSED_TIMEOUT = MAX_TIMEOUT
"""How long a paused sandbox (its snapshot) is kept without a connect."""
DEFAULT_TIMEOUT = 300
"""A resumed sandbox's timeout when the connect names none (the API's default for a new one)."""
MAX_OUTPUT = 64 << 20
"""Per call cap on a workspace's command output (the file helpers read files as base64 through it)."""
MAX_LISTENERS = 64
"""Streams (a command's ``Start``/``Connect``, ``WatchDir``) open at once on one sandbox: each holds a pump or a
watch that runs commands in the workspace."""
MAX_LISTENERS_TOTAL = 1024
"""The same over all of a server's sandboxes."""
_ID = re.compile(r"[a-z0-9]{1,64}")


def valid_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _iso(t: datetime.datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


@dataclass
class Process:
    """A command started through envd: ``pid`` inside the workspace, its control directory (``in`` FIFO, ``out``
    and ``err`` files, relative to ``CONTROL_DIR``) and how far its output was streamed."""

    pid: int
    dir: str
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    stdin: bool
    offsets: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    exit_code: int | None = None
    subscribers: list[MemoryObjectSendStream[dict[str, Any] | None]] = field(default_factory=list)
    pumping: bool = False
    user: str | None = None
    """Who runs it (None: the workspace's default user)."""
    stdin_closed: bool = False
    lost: str | None = None
    """Why its stream ended without an exit (the workspace's error: killed, or gone with its host)."""

    def copy(self) -> Process:
        """The record a fork or a resumed copy starts with: same process, no subscriber, no pump."""
        return Process(
            self.pid,
            self.dir,
            self.cmd,
            list(self.args),
            dict(self.envs),
            self.cwd,
            self.tag,
            self.stdin,
            dict(self.offsets),
            self.exit_code,
            user=self.user,
            stdin_closed=self.stdin_closed,
        )


@dataclass
class Kept:
    """A snapshot kept by ``create_snapshot``: what ``create`` restores, with the commands it carries."""

    snap: Snap
    out: SnapshotOut
    source: str
    processes: dict[int, Process]
    next_process: int
    cwd: str = HOME
    """Where commands start (a built template's WORKDIR)."""


class Sandbox:
    """One E2B sandbox: its workspace (None while paused), the snapshot a pause keeps, metadata, deadline and the
    envd access token its clients present."""

    def __init__(self, template_id: str, metadata: Mapping[str, str], timeout: int) -> None:
        self.id = secrets.token_hex(10)
        self.token = secrets.token_urlsafe(24)
        self.template_id = template_id
        self.metadata = dict(metadata)
        self.started_at = _now()
        self.deadline = 0.0
        self.end_at = self.started_at
        self.set_timeout(timeout)
        self.ws: Handle | None = None
        self.paused: Snap | None = None
        self.processes: dict[int, Process] = {}
        self.next_process = 0
        self.cwd = HOME
        """Where commands start unless they name a directory."""
        self.lock = anyio.Lock()
        """Held by lifecycle changes (pause, resume, kill, fork) so that they do not interleave."""
        self.listeners = 0
        """Streams open on it (``Sandboxes.listener``)."""

    def set_timeout(self, seconds: int) -> None:
        seconds = max(0, min(int(seconds), MAX_TIMEOUT))
        self.deadline = anyio.current_time() + seconds
        self.end_at = _now() + datetime.timedelta(seconds=seconds)

    @property
    def state(self) -> str:
        return "paused" if self.ws is None else "running"

    def workspace(self) -> Handle:
        """The live workspace, or ``unavailable`` for a paused sandbox (envd of a paused E2B sandbox is gone too)."""
        if self.ws is None or self.ws.closed:
            raise RpcError(f"sandbox {self.id} is not running (paused or killed)", code="unavailable")
        return self.ws

    def created(self, **detail: Any) -> SandboxOut:
        """E2B's ``Sandbox`` (create, connect, fork); with ``detail``, its ``SandboxDetail``."""
        return SandboxOut(
            template_id=self.template_id,
            sandbox_id=self.id,
            client_id="bunshin",
            envd_version=ENVD_VERSION,
            envd_access_token=self.token,
            **detail,
        )

    def detail(self) -> SandboxOut:
        limits = self.ws.limits if self.ws is not None else None
        return self.created(
            started_at=_iso(self.started_at),
            end_at=_iso(self.end_at),
            cpu_count=max(1, math.ceil(limits.cpus)) if limits is not None and limits.cpus else 1,
            memory_mb=(limits.memory >> 20) if limits is not None and limits.memory else 0,
            disk_size_mb=(limits.disk >> 20) if limits is not None and limits.disk else 0,
            state=self.state,
            metadata=self.metadata,
        )


class Sandboxes:
    """The registry (one per server), over a backend (where workspaces run: this host by default). Every method is
    safe to call concurrently; ``aclose`` closes everything."""

    def __init__(
        self, *, max_sandboxes: int = 256, default_image: Image | None = None, backend: Backend | None = None
    ) -> None:
        self.max_sandboxes = max_sandboxes
        self.default_image = default_image
        self.backend: Backend = backend or LocalBackend()
        self._sandboxes: dict[str, Sandbox] = {}
        self._snapshots: dict[str, Kept] = {}
        self._starting = 0
        self._builds: dict[str, Build] = {}
        self.reaped = 0
        """How many sandboxes the reaper closed because their timeout passed."""
        self.listeners = 0
        self.max_listeners = MAX_LISTENERS
        self.max_listeners_total = MAX_LISTENERS_TOTAL

    # ------------------------------------------------------------------------------------------------ lookups

    def get(self, sandbox_id: str) -> Sandbox:
        sb = self._sandboxes.get(sandbox_id) if valid_id(sandbox_id) else None
        if sb is None:
            raise ApiError(f"sandbox {sandbox_id!r} not found", status=404)
        return sb

    def matching(self, metadata: Mapping[str, str], states: set[str] | None) -> list[Sandbox]:
        return [
            sb
            for sb in self._sandboxes.values()
            if all(sb.metadata.get(k) == v for k, v in metadata.items()) and (not states or sb.state in states)
        ]

    def snapshots(self, sandbox_id: str | None) -> list[SnapshotOut]:
        unique = {id(k.snap): k for k in self._snapshots.values()}
        return [k.out for k in unique.values() if k.source and sandbox_id in (None, k.source)]

    def listener(self, sb: Sandbox) -> Callable[[], None]:
        """Count a stream opened on ``sb``; the function returned (idempotent) uncounts it. Refused with
        ``resource_exhausted`` past ``max_listeners`` on the sandbox or ``max_listeners_total`` on the server."""
        if sb.listeners >= self.max_listeners:
            raise RpcError(f"sandbox {sb.id} has {sb.listeners} streams open, its most", code="resource_exhausted")
        if self.listeners >= self.max_listeners_total:
            raise RpcError(f"this server has {self.listeners} streams open, its most", code="resource_exhausted")
        sb.listeners += 1
        self.listeners += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                sb.listeners -= 1
                self.listeners -= 1

        return release

    # ------------------------------------------------------------------------------------------------ lifecycle

    def _admit(self, n: int) -> None:
        if len(self._sandboxes) + self._starting + n > self.max_sandboxes:
            raise ApiError(f"this server runs at most {self.max_sandboxes} sandboxes", status=429)

    async def _image(self, template_id: str, metadata: Mapping[str, str]) -> Image | str | None:
        """The image a template id names (the backend resolves a reference: see ``Backend.image``)."""
        ref = template_id
        if template_id == DEFAULT_TEMPLATE:
            ref = next((metadata[k] for k in IMAGE_METADATA_KEYS if metadata.get(k)), "")
            if not ref:
                return self.default_image
        if not is_reference(ref):  # it reaches the Docker engine's API (in its URLs) and the image store
            raise ApiError(
                f"template {ref[:100]!r} is not a snapshot or template of this server nor an image reference "
                "([HOST[:PORT]/]NAME[:TAG][@DIGEST], lower-case name)",
                status=400,
            )
        return await self.backend.image(ref)

    async def fresh(
        self, template_id: str, metadata: Mapping[str, str], env: Mapping[str, str] | None = None
    ) -> Handle:
        """A new, prepared workspace of the image ``template_id`` names (the caller closes it)."""
        image = await self._image(template_id, metadata)
        ws = await self.backend.fresh(image, env=env or {}, workdir=CONTROL_DIR, max_output=MAX_OUTPUT)
        try:
            await prepare(ws)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await ws.aclose()
            raise
        return ws

    async def restore(self, template_id: str, lifetime: float = DEFAULT_TIMEOUT) -> Handle:
        """A copy of the snapshot or built template ``template_id`` names (the caller closes it); ``lifetime``: its
        expected stay (seconds, for placement)."""
        kept = self._snapshots.get(template_id)
        if kept is None:
            raise ApiError(f"no template or snapshot {template_id!r} on this server", status=404)
        (ws,) = await self.backend.restore(kept.snap, 1, lifetime)
        return ws

    async def create(self, req: NewSandbox) -> Sandbox:
        metadata = req.metadata or {}
        self._admit(1)
        self._starting += 1
        try:
            sb = Sandbox(req.template_id, metadata, req.timeout)
            kept = self._snapshots.get(req.template_id)
            if kept is not None:
                sb.ws = ws = await self.restore(req.template_id, req.timeout)
                try:
                    if req.env_vars:
                        await ws.configure(env=req.env_vars)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await ws.aclose()
                    raise
                sb.processes = {pid: p.copy() for pid, p in kept.processes.items()}
                sb.next_process = kept.next_process
                sb.cwd = kept.cwd
            else:
                sb.ws = await self.fresh(req.template_id, metadata, req.env_vars)
            self._sandboxes[sb.id] = sb
            return sb
        finally:
            self._starting -= 1

    # ------------------------------------------------------------------------------------------------ templates

    def template(self, alias: str) -> str | None:
        """The id of the built template or snapshot ``alias`` names, if any."""
        kept = self._snapshots.get(alias)
        return kept.out.snapshot_id if kept is not None else None

    def builds(self, template_id: str) -> Build:
        build = self._builds.get(template_id)
        if build is None:
            raise ApiError(f"template {template_id!r} not found", status=404)
        return build

    def request_build(self, name: str, tags: list[str]) -> Build:
        if not name or len(name) > 200:
            raise ApiError("a template needs a name (at most 200 characters)", status=400)
        build = Build(name, [name, *(f"{name}:{t}" for t in tags or ["default"])])
        self._builds[build.template_id] = build
        finished = [k for k, b in self._builds.items() if b.status in ("ready", "error")]
        for key in finished[: max(0, len(self._builds) - 256)]:  # forget the oldest finished builds
            del self._builds[key]
        return build

    async def keep_template(self, ws: Handle, build: Build, workdir: str) -> None:
        """Snapshot a built workspace under the template's id and names (replacing an older build of them)."""
        await own_home(ws)  # a build's steps may have added E2B's user
        snap = await self.backend.snapshot(ws)
        kept = Kept(snap, SnapshotOut(snapshot_id=build.template_id, names=list(build.aliases)), "", {}, 0, workdir)
        replaced = {id(self._snapshots[k].snap): self._snapshots[k] for k in build.aliases if k in self._snapshots}
        for key in [build.template_id, *build.aliases]:
            self._snapshots[key] = kept
        for old in replaced.values():
            if not any(v is old for v in self._snapshots.values()):
                await old.snap.aclose()

    async def kill(self, sandbox_id: str) -> None:
        sb = self.get(sandbox_id)
        del self._sandboxes[sb.id]
        await self._close(sb)

    async def _close(self, sb: Sandbox) -> None:
        with anyio.CancelScope(shield=True):
            async with sb.lock:
                ws, snap, sb.ws, sb.paused = sb.ws, sb.paused, None, None
                if ws is not None:
                    await ws.aclose()
                if snap is not None:
                    await snap.aclose()
                for proc in sb.processes.values():
                    end_subscribers(proc, None)

    async def pause(self, sandbox_id: str) -> bool:
        """False if it was paused already (E2B answers 409)."""
        sb = self.get(sandbox_id)
        async with sb.lock:
            if sb.ws is None:
                return False
            snap = await self.backend.snapshot(sb.ws)
            ws, sb.ws, sb.paused = sb.ws, None, snap
            sb.set_timeout(PAUSED_TIMEOUT)  # E2B keeps paused sandboxes; this server for a day
            with anyio.CancelScope(shield=True):
                await ws.aclose()
            for proc in sb.processes.values():
                end_subscribers(proc, None)
            return True

    async def connect(self, sandbox_id: str, timeout: int | None) -> Sandbox:
        """The sandbox, resumed from its pause snapshot if paused; ``timeout`` extends its life."""
        sb = self.get(sandbox_id)
        async with sb.lock:
            if sb.ws is None and sb.paused is not None:
                (sb.ws,) = await self.backend.restore(sb.paused, 1, timeout or DEFAULT_TIMEOUT)
                snap, sb.paused = sb.paused, None
                with anyio.CancelScope(shield=True):
                    await snap.aclose()
                sb.processes = {pid: p.copy() for pid, p in sb.processes.items()}
                sb.set_timeout(DEFAULT_TIMEOUT)  # not the paused one's day
        if timeout is not None:
            sb.set_timeout(timeout)
        return sb

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[Sandbox | ApiError]:
        """``count`` live copies (all or nothing in Bunshin: on failure every entry carries the error)."""
        if not 1 <= count <= 64:
            raise ApiError(f"count must be between 1 and 64, not {count}", status=400)
        sb = self.get(sandbox_id)
        self._admit(count)
        self._starting += count
        try:
            async with sb.lock:
                ws = sb.workspace()
                remaining = max(1, math.ceil(sb.deadline - anyio.current_time()))
                try:
                    copies = await self.backend.fork(ws, count, timeout if timeout is not None else remaining)
                except BunshinError as exc:
                    return [ApiError(f"fork of {sandbox_id} failed: {exc}", status=500) for _ in range(count)]
            out: list[Sandbox | ApiError] = []
            for ws_copy in copies:
                if isinstance(ws_copy, BunshinError):
                    out.append(ApiError(f"a copy of {sandbox_id} failed: {ws_copy}", status=500))
                    continue
                child = Sandbox(sb.template_id, sb.metadata, timeout if timeout is not None else remaining)
                child.ws = ws_copy
                child.processes = {pid: p.copy() for pid, p in sb.processes.items()}
                child.next_process = sb.next_process
                child.cwd = sb.cwd
                self._sandboxes[child.id] = child
                out.append(child)
            return out
        finally:
            self._starting -= count

    async def create_snapshot(self, sandbox_id: str, name: str | None) -> SnapshotOut:
        sb = self.get(sandbox_id)
        async with sb.lock:
            snap = await self.backend.snapshot(sb.workspace())
            processes = {pid: p.copy() for pid, p in sb.processes.items()}
        snap_id = f"snap{snap.id}"
        kept = Kept(snap, SnapshotOut(snapshot_id=snap_id, names=[name] if name else []), sb.id, processes, 0, sb.cwd)
        kept.next_process = sb.next_process
        self._snapshots[snap_id] = kept
        if name:  # a name is another id of the same snapshot, as E2B's templates have aliases
            self._snapshots.setdefault(name, kept)
        return kept.out

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        kept = self._snapshots.get(snapshot_id)
        if kept is None:
            return False
        for key in [k for k, v in self._snapshots.items() if v is kept]:
            del self._snapshots[key]
        await kept.snap.aclose()
        return True

    # ------------------------------------------------------------------------------------------------ reaper

    async def reap(self) -> None:
        """Close sandboxes whose timeout passed, until cancelled (checks every half second)."""
        while True:
            now = anyio.current_time()
            expired = [sb for sb in self._sandboxes.values() if sb.deadline <= now]
            for sb in expired:
                if self._sandboxes.pop(sb.id, None) is not None:
                    self.reaped += 1
                    await self._close(sb)
            await anyio.sleep(0.5)

    async def aclose(self) -> None:
        """Close every sandbox and snapshot (shielded)."""
        with anyio.CancelScope(shield=True):
            sandboxes, self._sandboxes = list(self._sandboxes.values()), {}
            snaps = {id(v.snap): v.snap for v in self._snapshots.values()}
            self._snapshots = {}
            async with anyio.create_task_group() as tg:
                for sb in sandboxes:
                    tg.start_soon(self._close, sb)
                for snap in snaps.values():
                    tg.start_soon(snap.aclose)


async def prepare(ws: Handle) -> None:
    """E2B's home directory exists in every sandbox (commands start there); commands of any user can make their
    control directories (sticky, as /tmp, but not listable: their names are secrets)."""
    await ws.exec(["/bin/sh", "-c", 'mkdir -p "$1" "$2" && chmod 1733 "$2"', "sh", HOME, f"{CONTROL_DIR}/p"])
    await own_home(ws)


async def own_home(ws: Handle) -> None:
    """E2B's user ``user`` owns its home, as in E2B's templates, where the image has that user (an image without
    it runs commands as its own user, root for the base image, and the home stays root's). A home the image
    already gave someone else is left alone, and so is one that is not a plain directory."""
    script = (
        'id -u user >/dev/null 2>&1 && [ -d "$1" ] && [ ! -L "$1" ] && [ "$(stat -c %u "$1")" = 0 ] '
        '&& chown user: "$1" || true'
    )
    # uid 0 by number: the agent resolves a name through the image's /etc/passwd, which need not list root
    await ws.exec(["/bin/sh", "-c", script, "sh", HOME], user="0")


def end_subscribers(proc: Process, message: dict[str, Any] | None) -> None:
    """Send ``message`` (None: the stream ends without an end event) to every subscriber and close them."""
    subs, proc.subscribers = proc.subscribers, []
    for send in subs:
        if message is not None:
            try:
                send.send_nowait(message)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        send.close()


__all__ = ["Process", "Sandbox", "Sandboxes"]
