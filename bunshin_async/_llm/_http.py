"""A small HTTP/1.1 server on anyio + h11: keep-alive, chunked streaming responses, and a way to cut a response
mid-body (fault injection). Enough for an OpenAI-compatible endpoint; not a general web server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import h11
import msgspec
from anyio.abc import ByteStream, SocketAttribute, TaskStatus

__all__ = ["HTTPRequest", "Handler", "Responder", "serve_http"]

MAX_BODY = 64 * 1024 * 1024
READ_SIZE = 65536


class HTTPRequest(msgspec.Struct, frozen=True):
    method: str
    path: str
    headers: dict[str, str]  # names lowercased; a repeated header keeps its last value
    body: bytes


class ConnectionCut(Exception):
    """The peer went away (or the handler cut the connection); the connection is dropped."""


class Responder:
    """Writes one response. ``start`` then ``send``* then ``end``, or ``respond`` for a whole body; ``cut`` drops
    the connection mid-response."""

    def __init__(self, conn: h11.Connection, stream: ByteStream) -> None:
        self._conn = conn
        self._stream = stream
        self.started = False

    async def _write(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        if data:
            try:
                await self._stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise ConnectionCut(str(exc)) from exc

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.started = True
        await self._write(h11.Response(status_code=status, headers=[("server", "bunshin-replay"), *headers]))

    async def send(self, data: bytes) -> None:
        if data:
            await self._write(h11.Data(data=data))

    async def end(self) -> None:
        await self._write(h11.EndOfMessage())

    async def respond(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        headers = [("content-type", content_type), ("content-length", str(len(body)))]
        await self.start(status, headers)
        await self.send(body)
        await self.end()

    async def cut(self) -> None:
        """Close the connection without finishing the response (the client sees an incomplete body)."""
        await self._stream.aclose()
        raise ConnectionCut("cut by the handler")


Handler = Callable[[HTTPRequest, Responder], Awaitable[None]]


async def _next_event(conn: h11.Connection, stream: ByteStream) -> h11.Event | type[h11.PAUSED]:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event  # type: ignore[return-value]  # h11 types the sentinels as classes
        try:
            data = await stream.receive(READ_SIZE)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            data = b""
        conn.receive_data(data)


async def _serve_connection(stream: ByteStream, handler: Handler) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=256 * 1024)
    async with stream:
        while True:
            try:
                event = await _next_event(conn, stream)
                if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    return
                if not isinstance(event, h11.Request):
                    return
                body = bytearray()
                while True:
                    part = await _next_event(conn, stream)
                    if isinstance(part, h11.Data):
                        body += part.data
                        if len(body) > MAX_BODY:
                            await Responder(conn, stream).respond(413, b'{"error":{"message":"body too large"}}')
                            return
                    elif isinstance(part, h11.EndOfMessage):
                        break
                    else:
                        return  # the client went away mid-request
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    msg = msgspec.json.encode({"error": {"message": f"bad HTTP request: {exc}"}})
                    try:
                        await Responder(conn, stream).respond(exc.error_status_hint, msg)
                    except (ConnectionCut, h11.LocalProtocolError):
                        pass
                return
            request = HTTPRequest(
                method=event.method.decode(),
                path=event.target.decode().split("?", 1)[0],
                headers={k.decode().lower(): v.decode("latin-1") for k, v in event.headers},
                body=bytes(body),
            )
            responder = Responder(conn, stream)
            try:
                await handler(request, responder)
            except ConnectionCut:
                return
            except Exception as exc:  # a bug in the handler must not take the server down
                if not responder.started:
                    error = {"message": f"internal error: {exc!r}", "type": "server_error"}
                    msg = msgspec.json.encode({"error": error})
                    try:
                        await responder.respond(500, msg)
                    except (ConnectionCut, h11.LocalProtocolError):
                        return
                else:
                    return
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return


async def serve_http(
    handler: Handler,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; ``task_status.started`` gets the bound port (``port=0`` picks a free one)."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    async with listener:
        bound = listener.extra(SocketAttribute.local_port)
        task_status.started(bound)

        async def handle(stream: ByteStream) -> None:
            await _serve_connection(stream, handler)

        await listener.serve(handle)
