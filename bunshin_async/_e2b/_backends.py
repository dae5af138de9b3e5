"""Where a server's sandboxes run: this host's workspaces (``LocalBackend``) or the hosts of a Ray cluster
(``_ray.RayBackend``). The registry and the routes see only a ``Handle`` (a sandbox's workspace: commands, the
process ops envd needs, files) and an opaque ``Snap``; the backend decides where a new workspace, a copy or a
restored snapshot goes, and which of its errors mean "the sandbox is gone" (``WorkspaceClosed``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import anyio

from .._exceptions import BunshinError, ImageError
from .._fork._snapshot import Snapshot
from .._host._kernel import Limits
from .._host._protocol import ExecResult
from .._images._image import Image
from .._workspace._facade import BackgroundProcess, Workspace
from ._wire import ApiError


class Snap(Protocol):
    """A snapshot a backend made (a pause, ``create_snapshot``, a built template): its owner closes it."""

    @property
    def id(self) -> str: ...

    async def aclose(self) -> None: ...


class Handle(Protocol):
    """A sandbox's workspace as the registry and envd drive it. ``node`` says where it runs (None: this host)."""

    @property
    def id(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    @property
    def node(self) -> str | None: ...

    @property
    def limits(self) -> Limits | None: ...

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> ExecResult: ...

    async def spawn(
        self,
        cmd: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
    ) -> int:
        """The in-workspace pid of a background process (``poll`` and ``signal`` take it)."""
        ...

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes: ...

    async def poll(self, pid: int) -> int | None: ...

    async def signal(self, pid: int, sig: int) -> None: ...

    async def configure(self, *, env: Mapping[str, str] | None = None, user: str | None = None) -> None:
        """Add ``env`` to later commands' environment; ``user`` becomes their default user."""
        ...

    async def aclose(self) -> None: ...


class Backend(Protocol):
    """Makes, copies and snapshots sandboxes' workspaces. ``open``/``aclose`` bracket the server's life;
    ``aclose`` frees whatever is left of what it made."""

    async def open(self) -> None: ...

    async def aclose(self) -> None: ...

    async def image(self, ref: str) -> Image | str:
        """What a template reference names (raises ``ApiError`` 404 if nothing here knows it)."""
        ...

    async def fresh(
        self, image: Image | str | None, *, env: Mapping[str, str], workdir: str, max_output: int
    ) -> Handle: ...

    async def snapshot(self, ws: Handle) -> Snap: ...

    async def restore(self, snap: Snap, n: int, lifetime: float) -> list[Handle]:
        """``n`` copies of ``snap`` (all or nothing); ``lifetime``: how long they are expected to hold their slots
        (seconds, for placement)."""
        ...

    async def fork(self, ws: Handle, n: int, lifetime: float) -> list[Handle | BunshinError]:
        """``n`` live copies of ``ws``: each a handle, or the error that copy failed with."""
        ...


def template_not_found(ref: str, exc: BaseException) -> ApiError:
    return ApiError(
        f"template {ref!r} is neither a snapshot of this server, an imported image nor an image of the local "
        f"Docker engine ({exc}); template builds are not served: import the image with "
        "`bunshin image import REF --name NAME`",
        status=404,
    )


class LocalHandle:
    """A workspace on this host."""

    node = None

    def __init__(self, ws: Workspace) -> None:
        self.workspace = ws

    @property
    def id(self) -> str:
        return self.workspace.id

    @property
    def closed(self) -> bool:
        return self.workspace.closed

    @property
    def limits(self) -> Limits | None:
        return self.workspace.limits

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> ExecResult:
        return await self.workspace.exec(cmd, cwd=cwd, stdin=stdin, timeout=timeout, user=user)

    async def spawn(
        self,
        cmd: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
    ) -> int:
        return (await self.workspace.spawn(cmd, cwd=cwd, env=env, user=user)).pid

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        return await self.workspace.read_file(path, max_bytes=max_bytes)

    async def poll(self, pid: int) -> int | None:
        return await BackgroundProcess(self.workspace, pid).poll()

    async def signal(self, pid: int, sig: int) -> None:
        await BackgroundProcess(self.workspace, pid).signal(sig)

    async def configure(self, *, env: Mapping[str, str] | None = None, user: str | None = None) -> None:
        if env:
            self.workspace.env = {**self.workspace.env, **env}
        if user is not None:
            self.workspace.user = user

    async def aclose(self) -> None:
        await self.workspace.aclose()


class LocalBackend:
    """Workspaces on this host; template references are imported images or the local Docker engine's (imported
    once: concurrent creates of one reference share the import)."""

    def __init__(self) -> None:
        self._imports: dict[str, anyio.Lock] = {}

    async def open(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def image(self, ref: str) -> Image:
        try:
            return await anyio.to_thread.run_sync(Image.load, ref)
        except ImageError:
            pass
        lock = self._imports.setdefault(ref, anyio.Lock())
        try:
            async with lock:
                try:
                    return await anyio.to_thread.run_sync(Image.load, ref)  # imported while this one waited
                except ImageError:
                    return await Image.from_docker(ref)
        except (BunshinError, OSError) as exc:
            raise template_not_found(ref, exc) from exc
        finally:
            if not lock.locked() and self._imports.get(ref) is lock:
                del self._imports[ref]

    async def fresh(
        self, image: Image | str | None, *, env: Mapping[str, str], workdir: str, max_output: int
    ) -> LocalHandle:
        ws = Workspace(image, workdir=workdir, env=env, max_output=max_output)
        await ws.start()
        return LocalHandle(ws)

    async def snapshot(self, ws: Handle) -> Snapshot:
        assert isinstance(ws, LocalHandle)
        return await ws.workspace.snapshot()

    async def restore(self, snap: Snap, n: int, lifetime: float) -> list[Handle]:
        assert isinstance(snap, Snapshot)
        return [LocalHandle(ws) for ws in await Workspace.from_snapshot(snap, n)]

    async def fork(self, ws: Handle, n: int, lifetime: float) -> list[Handle | BunshinError]:
        assert isinstance(ws, LocalHandle)
        return [LocalHandle(c) for c in await ws.workspace.fork(n)]
