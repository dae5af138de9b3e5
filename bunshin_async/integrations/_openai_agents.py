"""A sandbox backend for the OpenAI Agents SDK (``agents.sandbox``) on Bunshin workspaces.

``BunshinSandboxClient`` implements the SDK's ``BaseSandboxClient`` (create, delete, resume, state
serialization) and ``BunshinSandboxSession`` its ``BaseSandboxSession`` (exec, read, write, running,
persist/hydrate), so a ``SandboxAgent`` runs its shell and file tools in an isolated, forkable workspace::

    async with BunshinSandboxClient() as client:
        run_config = RunConfig(sandbox=SandboxRunConfig(client=client, options=BunshinSandboxClientOptions()))
        result = await Runner.run(agent, "fix the bug", run_config=run_config)

``client.fork(session, n)`` returns ``n`` live copies of a session (processes, memory and files: BunshinFork),
each a session of its own, for a group of rollouts that share a set-up. A serialized session state names its live
workspace; ``resume`` in the same process reattaches to it, elsewhere (or once it is gone) it starts a fresh one
and hydrates it from the state's snapshot as the SDK does for every backend. The client owns the workspaces it
made: leaving ``async with`` (or ``aclose()``) closes every one still open, whatever the Runner did, so a
cancelled or timed-out run leaves none behind.
"""

from __future__ import annotations

import io
import uuid
from pathlib import Path
from types import TracebackType
from typing import Literal

import anyio

from .._exceptions import BunshinError, FileNotFound, InvalidValue, ToolTimeout
from .._host._kernel import Limits
from .._images._image import Image
from .._workspace._facade import Workspace
from ._require import require

require("agents.sandbox", framework="the OpenAI Agents SDK", extra="openai-agents")

from agents.sandbox import Manifest  # noqa: E402
from agents.sandbox.errors import (  # noqa: E402
    ExecTimeoutError,
    ExecTransportError,
    ExposedPortUnavailableError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
)
from agents.sandbox.session import BaseSandboxClient, BaseSandboxClientOptions, SandboxSessionState  # noqa: E402
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession  # noqa: E402
from agents.sandbox.session.sandbox_session import SandboxSession  # noqa: E402
from agents.sandbox.session.workspace_payloads import coerce_write_payload  # noqa: E402
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot  # noqa: E402
from agents.sandbox.types import ExecResult, ExposedPortEndpoint, User  # noqa: E402

__all__ = [
    "BunshinSandboxClient",
    "BunshinSandboxClientOptions",
    "BunshinSandboxSession",
    "BunshinSandboxSessionState",
]

_ARCHIVE = ".bunshin-archive.tar"  # staged in the workspace root while persisting or hydrating
#: The largest workspace archive ``persist_workspace`` hands out (the workspace decides its size: bound it).
MAX_ARCHIVE_BYTES = 1 << 30


class BunshinSandboxClientOptions(BaseSandboxClientOptions):
    """Per-session settings: the workspace's limits (``memory`` bytes, ``pids``, ``cpus``) and a virtual display."""

    type: Literal["bunshin"] = "bunshin"
    memory: int | None = None
    pids: int | None = None
    cpus: float | None = None
    display: bool = False


class BunshinSandboxSessionState(SandboxSessionState):
    """The SDK's session state plus the live workspace it runs in (``workspace_id``, empty once gone) and the
    options to start a replacement with."""

    type: Literal["bunshin"] = "bunshin"
    workspace_id: str = ""
    options: BunshinSandboxClientOptions = BunshinSandboxClientOptions()


def _limits(options: BunshinSandboxClientOptions) -> Limits:
    defaults = Limits()
    return Limits(
        memory=options.memory if options.memory is not None else defaults.memory,
        pids=options.pids if options.pids is not None else defaults.pids,
        cpus=options.cpus if options.cpus is not None else defaults.cpus,
    )


class BunshinSandboxSession(BaseSandboxSession):
    """One SDK sandbox session on one Bunshin workspace (``workspace``). Commands run as the workspace's root
    user, in its namespaces; the manifest root is the workspace's working directory."""

    state: BunshinSandboxSessionState

    def __init__(
        self, *, state: BunshinSandboxSessionState, client: BunshinSandboxClient, workspace: Workspace | None = None
    ) -> None:
        self.state = state
        self._client = client
        self._ws = workspace
        if workspace is not None:
            state.workspace_id = workspace.id

    @property
    def workspace(self) -> Workspace:
        if self._ws is None or self._ws.closed:
            raise ExecTransportError(command=("workspace",), context={"reason": "workspace_not_running"})
        return self._ws

    # ------------------------------------------------------------------------------------------ lifecycle

    async def _ensure_backend_started(self) -> None:
        if self._ws is not None and not self._ws.closed:
            return
        self._ws = await self._client._start_workspace(self.state)
        self.state.workspace_id = self._ws.id

    async def _shutdown_backend(self) -> None:
        ws, self._ws = self._ws, None
        self.state.workspace_id = ""
        if ws is not None:
            await self._client._close_workspace(ws)

    async def running(self) -> bool:
        return self._ws is not None and not self._ws.closed

    async def _resolve_exposed_port(self, port: int) -> ExposedPortEndpoint:
        # A workspace has a loopback-only network namespace: nothing inside is reachable from the host.
        raise ExposedPortUnavailableError(port=port, exposed_ports=self.state.exposed_ports, reason="not_supported")

    # ------------------------------------------------------------------------------------------ commands and files

    async def _exec_internal(self, *command: str | Path, timeout: float | None = None) -> ExecResult:
        argv = [str(c) for c in command]
        try:
            r = await self.workspace.exec(argv, timeout=timeout)
        except ToolTimeout as exc:
            raise ExecTimeoutError(command=argv, timeout_s=timeout, cause=exc) from exc
        except BunshinError as exc:
            raise ExecTransportError(command=argv, cause=exc) from exc
        return ExecResult(stdout=r.stdout.encode(), stderr=r.stderr.encode(), exit_code=r.exit_code)

    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        if user is not None:
            await self._check_read_with_exec(path, user=user)
        target = self.normalize_path(path)
        try:
            return io.BytesIO(await self.workspace.read_file(str(target)))
        except FileNotFound as exc:
            raise WorkspaceReadNotFoundError(path=path, cause=exc) from exc
        except BunshinError as exc:
            raise WorkspaceArchiveReadError(path=path, cause=exc) from exc

    async def write(self, path: Path, data: io.IOBase, *, user: str | User | None = None) -> None:
        target = self.normalize_path(path, for_write=True)
        payload = coerce_write_payload(path=target, data=data)
        raw = await anyio.to_thread.run_sync(payload.stream.read)
        if user is not None:
            await self._check_write_with_exec(target, user=user)
        try:
            await self.workspace.write_file(str(target), raw)
        except BunshinError as exc:
            raise WorkspaceArchiveWriteError(path=target, cause=exc) from exc

    async def persist_workspace(self) -> io.IOBase:
        """A tar of the workspace root (minus the SDK's skip paths), built inside the workspace."""
        root = self.state.manifest.root
        excludes = [f"--exclude=./{p.as_posix()}" for p in sorted(self._persist_workspace_skip_relpaths())]
        argv = ["tar", "-C", root, f"--exclude=./{_ARCHIVE}", *excludes, "-cf", f"{root}/{_ARCHIVE}", "."]
        try:
            r = await self.workspace.exec(argv, timeout=600)
            if r.exit_code != 0:
                raise WorkspaceArchiveReadError(path=Path(root), context={"stderr": r.stderr[-2000:]})
            size = await self.workspace.exec(["stat", "-c", "%s", f"{root}/{_ARCHIVE}"], timeout=60)
            if size.exit_code != 0 or not size.stdout.strip().isdigit() or int(size.stdout) > MAX_ARCHIVE_BYTES:
                reason = f"archive larger than {MAX_ARCHIVE_BYTES} bytes or unreadable: {size.stdout.strip()!r}"
                raise WorkspaceArchiveReadError(path=Path(root), context={"reason": reason})
            data = await self.workspace.read_file(f"{root}/{_ARCHIVE}", max_bytes=MAX_ARCHIVE_BYTES)
            return io.BytesIO(data)
        except BunshinError as exc:
            raise WorkspaceArchiveReadError(path=Path(root), cause=exc) from exc
        finally:
            with anyio.CancelScope(shield=True):
                if self._ws is not None and not self._ws.closed:
                    await self._ws.exec(["rm", "-f", f"{root}/{_ARCHIVE}"], timeout=60)

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        """Unpack a ``persist_workspace`` tar into the workspace root. It is unpacked by the workspace's own tar,
        inside its namespaces: a hostile archive can only damage the workspace it is put in."""
        root = self.state.manifest.root
        raw = await anyio.to_thread.run_sync(data.read)
        if not isinstance(raw, bytes):
            raise WorkspaceArchiveWriteError(path=Path(root), context={"reason": "archive is not bytes"})
        try:
            await self.workspace.write_file(f"{root}/{_ARCHIVE}", raw)
            r = await self.workspace.exec(
                ["tar", "-C", root, "--no-same-owner", "-xf", f"{root}/{_ARCHIVE}"], timeout=600
            )
            if r.exit_code != 0:
                raise WorkspaceArchiveWriteError(path=Path(root), context={"stderr": r.stderr[-2000:]})
        except BunshinError as exc:
            raise WorkspaceArchiveWriteError(path=Path(root), cause=exc) from exc
        finally:
            with anyio.CancelScope(shield=True):
                if self._ws is not None and not self._ws.closed:
                    await self._ws.exec(["rm", "-f", f"{root}/{_ARCHIVE}"], timeout=60)


class BunshinSandboxClient(BaseSandboxClient[BunshinSandboxClientOptions | None]):
    """Creates SDK sandbox sessions on Bunshin workspaces (module doc). ``image`` defaults to the Debian base
    image. Use as ``async with BunshinSandboxClient() as client``; ``aclose()`` closes every workspace the client
    started that is still open."""

    backend_id = "bunshin"
    supports_default_options = True

    def __init__(self, *, image: Image | None = None) -> None:
        super().__init__()
        self.image = image
        self._live: dict[str, Workspace] = {}

    @property
    def live_workspaces(self) -> list[Workspace]:
        """The workspaces of this client's sessions that are open now."""
        return [ws for ws in self._live.values() if not ws.closed]

    async def _start_workspace(self, state: BunshinSandboxSessionState) -> Workspace:
        options = state.options
        ws = Workspace(
            self.image, limits=_limits(options), workdir=state.manifest.root, display=options.display or None
        )
        await ws.start()  # removes what it made on failure or cancellation
        self._live[ws.id] = ws
        return ws

    async def _close_workspace(self, ws: Workspace) -> None:
        self._live.pop(ws.id, None)
        with anyio.CancelScope(shield=True):
            await ws.aclose()

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: BunshinSandboxClientOptions | None = None,
    ) -> SandboxSession:
        """A session whose workspace starts when the session does (``start()``, ``async with``, or the Runner)."""
        manifest = self._validate_manifest_for_create(manifest if manifest is not None else Manifest())
        session_id = uuid.uuid4()
        state = BunshinSandboxSessionState(
            session_id=session_id,
            manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)),
            options=options if options is not None else BunshinSandboxClientOptions(),
        )
        return self._wrap_session(BunshinSandboxSession(state=state, client=self))

    async def delete(self, session: SandboxSession) -> SandboxSession:
        inner = session._inner
        if not isinstance(inner, BunshinSandboxSession):
            # the Agents SDK's protocol: its own sandbox clients raise TypeError for another client's session
            raise TypeError("BunshinSandboxClient.delete expects a BunshinSandboxSession")
        await inner.shutdown()
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        if not isinstance(state, BunshinSandboxSessionState):
            # the Agents SDK's protocol (as delete)
            raise TypeError("BunshinSandboxClient.resume expects a BunshinSandboxSessionState")
        state.assert_path_grants_rebound()
        live = self._live.get(state.workspace_id)
        if live is not None and live.closed:
            live = None
        inner = BunshinSandboxSession(state=state, client=self, workspace=live)
        # A live workspace keeps its files and processes: start() then skips the manifest and snapshot.
        inner._set_start_state_preserved(live is not None)
        if live is None:
            state.workspace_id = ""
            state.workspace_root_ready = False
        return self._wrap_session(inner)

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, BunshinSandboxSessionState)

    async def fork(self, session: SandboxSession | BunshinSandboxSession, n: int = 1) -> list[SandboxSession]:
        """``n`` live copies of a started session (BunshinFork of its workspace: processes, memory, files), each a
        session of its own with a fresh id. All or nothing; the source keeps running. Delete each copy (or leave
        it to ``aclose()``)."""
        inner = session._inner if isinstance(session, SandboxSession) else session
        if not isinstance(inner, BunshinSandboxSession):
            # the Agents SDK's protocol (as delete)
            raise TypeError("BunshinSandboxClient.fork expects a BunshinSandboxSession")
        if n < 1:
            raise InvalidValue("n must be at least 1", argument="n")
        copies = await inner.workspace.fork(n)
        for ws in copies:
            self._live[ws.id] = ws
        out: list[SandboxSession] = []
        for ws in copies:
            state = inner.state.model_copy(deep=True, update={"session_id": uuid.uuid4()})
            state.workspace_root_ready = True
            copy = BunshinSandboxSession(state=state, client=self, workspace=ws)
            copy._set_start_state_preserved(True)
            out.append(self._wrap_session(copy))
        return out

    async def aclose(self) -> None:
        """Close every workspace this client started that is still open. Idempotent."""
        with anyio.CancelScope(shield=True):
            while self._live:
                _, ws = self._live.popitem()
                await ws.aclose()

    async def __aenter__(self) -> BunshinSandboxClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
