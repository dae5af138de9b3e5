"""``E2BServer``: the app, the sandbox registry and its reaper, served by uvicorn on one port."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import secrets
import socket
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from .._exceptions import BunshinError, InvalidArgument, ServeError
from .._images._image import Image
from ._app import E2BApp
from ._backends import Backend, LocalBackend
from ._sandboxes import Sandboxes

if TYPE_CHECKING:
    import uvicorn

    from ..integrations.ray import RayCluster


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class E2BServer:
    """An E2B-compatible endpoint on Bunshin workspaces: ``async with E2BServer() as srv:`` serves on
    ``srv.url`` until the block ends, then closes every sandbox and snapshot it made.

    Point the unmodified ``e2b`` SDK at it with ``srv.env`` (``E2B_API_URL`` and ``E2B_SANDBOX_URL`` are its URL,
    ``E2B_API_KEY`` its key). ``api_key`` defaults to a random one (``srv.api_key``); a ``host`` other than a
    loopback address needs an explicit key, since whoever reaches the port drives root-run workspaces. ``port=0``
    takes a free port. ``image`` is what the default template ``"base"`` means (default: Bunshin's base image);
    other template ids name imported images (``bunshin image import``), images of the local Docker engine (imported
    on first use) or this server's snapshots.
    ``max_sandboxes`` bounds the sandboxes alive at once (creating more answers 429).

    ``ray`` fronts a Ray cluster instead of this host (the ``ray`` extra): a ``RayCluster`` of workspace hosts
    (``integrations.ray``; the server drives them as an owner of its own, freed when it stops), or the address of a
    Ray cluster (``"auto"``, ``"HOST:PORT"``), on whose alive nodes the server starts a host each (``ray_slots``
    workspaces at once) and stops them when it stops. Sandboxes are placed by the integration (see
    docs/integrations/e2b.md, "Cluster"); template references then name images imported on the hosts.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        image: Image | None = None,
        max_sandboxes: int = 256,
        ray: RayCluster | str | None = None,
        ray_slots: int = 16,
    ) -> None:
        if not is_loopback(host) and not api_key:
            raise InvalidArgument(
                f"refusing to serve E2B on {host} without an API key: anyone reaching it runs root-run workspaces",
                tool="e2b serve",
            )
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"port {port} is not a TCP port (0-65535; 0 picks a free one)", tool="e2b serve")
        if api_key is not None and len(api_key) < 8:
            raise InvalidArgument("the API key must be at least 8 characters", tool="e2b serve")
        self.host = host
        self.port = port
        self.api_key = api_key or secrets.token_urlsafe(24)
        backend: Backend = LocalBackend()
        if ray is not None:
            from ._ray import RayBackend  # the ray extra, imported only by a server that fronts a cluster

            backend = RayBackend(ray, slots=ray_slots)
        self.sandboxes = Sandboxes(max_sandboxes=max_sandboxes, default_image=image, backend=backend)
        self._tg: TaskGroup | None = None
        self._http: uvicorn.Server | None = None
        self._served = anyio.Event()
        self._sock: socket.socket | None = None
        self._opened = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment the ``e2b`` SDK reads to reach this server."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key}

    async def __aenter__(self) -> E2BServer:
        """Bind, open the backend and start serving. On any failure or cancellation, whatever was made so far (the
        socket, the backend's hosts, the tasks) is released before the exception leaves: a failure to start is a
        ``ServeError`` (a ``BunshinError`` of the backend, such as a Ray cluster that cannot be joined, as itself)."""
        try:
            await self._start()
        except BaseException as exc:
            await self._abort(exc)
            if isinstance(exc, Exception) and not isinstance(exc, BunshinError):
                raise ServeError(f"the E2B server on {self.url} did not start: {exc}", address=self.url) from exc
            raise
        return self

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted sockets inherit it (Linux): a response's head and body, written apart, must not wait for
            # the client's delayed ACK (40 ms a request otherwise).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, self.port))
            sock.listen(256)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            taken = " (the port is taken)" if exc.errno == errno.EADDRINUSE else ""
            raise ServeError(f"cannot listen on {self.url}{taken}: {exc}", address=self.url) from exc
        return sock

    async def _start(self) -> None:
        import uvicorn

        ready = anyio.Event()

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield  # signals belong to whoever runs the server (the CLI stops it on SIGTERM/SIGINT)

            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets=sockets)
                ready.set()

        self._sock = sock = self._bind()
        self.port = sock.getsockname()[1]
        await self.sandboxes.backend.open()
        self._opened = True
        self._tg = tg = anyio.create_task_group()
        await tg.__aenter__()
        app = E2BApp(self.sandboxes, self.api_key, tg)
        http = Quiet(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5))
        self._http = http
        failed: list[BaseException] = []

        async def serve() -> None:
            try:
                await http.serve(sockets=[sock])
            except (Exception, SystemExit) as exc:  # uvicorn exits (sys.exit) when its start fails
                failed.append(exc)
            finally:
                self._served.set()
                ready.set()

        tg.start_soon(serve)
        tg.start_soon(self.sandboxes.reap)
        await ready.wait()
        if not http.started or self._served.is_set():
            cause = failed[0] if failed else None
            raise ServeError(f"the E2B server on {self.url} did not start: {cause!r}", address=self.url) from cause

    async def _abort(self, exc: BaseException) -> None:
        """Undo a start that failed or was cancelled (``exc``): the tasks end (the task group is left from this task,
        as it was entered), then the socket and the backend are released, shielded."""
        tg, self._tg = self._tg, None
        try:
            if tg is not None:
                if self._http is not None:
                    self._http.should_exit = True
                tg.cancel_scope.cancel()
                with contextlib.suppress(BaseException):  # ``exc`` is what the caller sees
                    await tg.__aexit__(type(exc), exc, exc.__traceback__)
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()

    async def aclose(self) -> None:
        """Stop serving, close every sandbox and snapshot. Idempotent."""
        tg, self._tg = self._tg, None
        if tg is None:
            return
        with anyio.CancelScope(shield=True):
            if self._http is not None:
                self._http.should_exit = True  # requests in flight get timeout_graceful_shutdown to finish
                with anyio.move_on_after(10):
                    await self._served.wait()
        # Pumps, builds and the reaper end first (a build closes its workspace), so that nothing registers a sandbox
        # or snapshot after the registry is closed (which shields itself).
        tg.cancel_scope.cancel()
        try:
            await tg.__aexit__(None, None, None)
        finally:
            await self._release()

    async def _release(self) -> None:
        """Close the socket, every sandbox and snapshot, and the backend (shielded: they shield themselves)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._opened:
            self._opened = False
            try:
                await self.sandboxes.aclose()
            finally:
                await self.sandboxes.backend.aclose()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
