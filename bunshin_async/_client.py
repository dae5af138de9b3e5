"""The host end of the agent protocol: one Unix-socket connection per request in flight, pooled when idle.

A request cancelled mid-flight closes its connection; the agent sees the hang-up and kills the command it was
running, so cancellation leaves no process behind. The socket lives inside the workspace, so whatever answers on it
is untrusted: a frame larger than ``MAX_FRAME`` or a body that is not a response is an ``AgentError``, a hang-up a
``WorkspaceClosed``.
"""

from __future__ import annotations

import struct

import anyio
from anyio.abc import SocketStream

from . import _protocol as P
from ._exceptions import AgentError, WorkspaceClosed

_header = struct.Struct(">I")
MAX_FRAME = 1 << 31
"""Largest answer read from the agent (bytes)."""


class AgentClient:
    def __init__(self, socket_path: str, workspace_id: str) -> None:
        self.socket_path = socket_path
        self.workspace_id = workspace_id
        self._idle: list[SocketStream] = []
        self._closed = False
        self._open = anyio.Event()  # cleared while a snapshot quiesces the client
        self._open.set()
        self._in_flight = 0
        self._drained = anyio.Event()

    async def _connect(self) -> SocketStream:
        if self._idle:
            return self._idle.pop()
        try:
            return await anyio.connect_unix(self.socket_path)
        except OSError as exc:
            raise WorkspaceClosed(
                f"workspace {self.workspace_id} does not answer: {exc}", workspace_id=self.workspace_id
            ) from exc

    async def request(self, req: P.Request) -> P.Response:
        while not self._open.is_set():
            await self._open.wait()
        self._in_flight += 1
        try:
            return await self._request(req)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    async def quiesce(self) -> None:
        """Let calls in flight finish, hold new ones until ``resume`` and close every idle connection, so that the
        agent holds no connection to the host (CRIU cannot dump one: a snapshot quiesces its workspace's client)."""
        self._open = anyio.Event()
        while self._in_flight:
            self._drained = anyio.Event()
            await self._drained.wait()
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    def resume(self) -> None:
        self._open.set()

    async def _request(self, req: P.Request) -> P.Response:
        if self._closed:
            raise WorkspaceClosed(f"workspace {self.workspace_id} is closed", workspace_id=self.workspace_id)
        payload = P.request_encoder.encode(req)
        conn = await self._connect()
        ok = False
        try:
            await conn.send(_header.pack(len(payload)) + payload)
            size = _header.unpack(await _receive_exact(conn, 4))[0]
            if size > MAX_FRAME:
                raise AgentError(
                    f"workspace {self.workspace_id}: the agent announced a {size}-byte answer to "
                    f"{type(req).__name__}, over the {MAX_FRAME}-byte limit",
                    workspace_id=self.workspace_id,
                )
            body = await _receive_exact(conn, size)
            ok = True
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise WorkspaceClosed(
                f"workspace {self.workspace_id} went away during {type(req).__name__}: {exc!r}",
                workspace_id=self.workspace_id,
            ) from exc
        finally:
            if ok and not self._closed:
                self._idle.append(conn)
            else:
                with anyio.CancelScope(shield=True):
                    await conn.aclose()
        try:
            resp: P.Response = P.response_decoder.decode(body)
            return resp
        except Exception as exc:
            raise AgentError(f"undecodable agent response: {exc}", workspace_id=self.workspace_id) from exc

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()


async def _receive_exact(conn: SocketStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await conn.receive(min(n - len(buf), 1 << 20))
        buf += chunk
    return bytes(buf)
