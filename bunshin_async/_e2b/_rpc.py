"""envd's Connect calls once the app has routed and authorised them: the unary process and filesystem calls
(``EnvdRpc.unary``) and the server streams of a command's output or a directory's changes (``EnvdRpc.stream``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from . import _envd
from ._sandboxes import Process, Sandbox, Sandboxes
from ._wire import (
    HTTP_STATUS,
    KEEPALIVE_EVENT,
    ConnectRequest,
    MoveRequest,
    PathRequest,
    RpcError,
    SelectRequest,
    SendInputRequest,
    SendSignalRequest,
    StartRequest,
    WatchRequest,
    end_stream,
    envelope,
    error_body,
    start_event,
)

_json = msgspec.json.Encoder()


def _rpc_decode(data: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(data or b"{}", type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RpcError(f"invalid request message: {exc}", code="invalid_argument") from exc


def rpc_error(exc: RpcError, streaming: bool) -> Response:
    if streaming:
        return Response(end_stream(exc), 200, media_type="application/connect+json")
    return Response(error_body(exc.code, exc.message), HTTP_STATUS[exc.code], media_type="application/json")


class EnvdRpc:
    """The Connect calls on the sandboxes of ``sandboxes``; pumps of command output run in ``tg`` (the server's task
    group)."""

    def __init__(self, sandboxes: Sandboxes, tg: TaskGroup) -> None:
        self.sandboxes = sandboxes
        self.tg = tg
        self.unary: dict[str, Callable[[Sandbox, bytes, str | None], Awaitable[Any]]] = {
            "process.Process/List": self.p_list,
            "process.Process/SendInput": self.p_send_input,
            "process.Process/SendSignal": self.p_send_signal,
            "process.Process/CloseStdin": self.p_close_stdin,
            "process.Process/Update": self.p_unimplemented,
            "filesystem.Filesystem/Stat": self.f_stat,
            "filesystem.Filesystem/MakeDir": self.f_make_dir,
            "filesystem.Filesystem/Move": self.f_move,
            "filesystem.Filesystem/ListDir": self.f_list_dir,
            "filesystem.Filesystem/Remove": self.f_remove,
        }

    # unary process calls

    async def p_list(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        return await _envd.running(sb)

    async def p_send_input(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        req = _rpc_decode(body, SendInputRequest)
        if req.input.stdin is None:
            raise RpcError("only stdin input is supported (no PTY)", code="unimplemented")
        await _envd.send_input(sb, _envd.find_process(sb, req.process), req.input.stdin)
        return {}

    async def p_send_signal(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        req = _rpc_decode(body, SendSignalRequest)
        await _envd.send_signal(sb, _envd.find_process(sb, req.process), req.signal)
        return {}

    async def p_close_stdin(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        await _envd.close_stdin(sb, _envd.find_process(sb, _rpc_decode(body, SelectRequest).process))
        return {}

    async def p_unimplemented(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        _envd.find_process(sb, _rpc_decode(body, SelectRequest).process)
        raise RpcError(
            "PTY sessions are not served by this server (a workspace's commands have no terminal): resizing one is "
            "not either",
            code="unimplemented",
        )

    # unary filesystem calls

    async def f_stat(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        return {"entry": await _envd.stat(sb.workspace(), _rpc_decode(body, PathRequest).path, user)}

    async def f_make_dir(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        return {"entry": await _envd.make_dir(sb.workspace(), _rpc_decode(body, PathRequest).path, user)}

    async def f_move(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        req = _rpc_decode(body, MoveRequest)
        return {"entry": await _envd.move(sb.workspace(), req.source, req.destination, user)}

    async def f_list_dir(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        req = _rpc_decode(body, PathRequest)
        return {"entries": await _envd.list_dir(sb.workspace(), req.path, req.depth, user)}

    async def f_remove(self, sb: Sandbox, body: bytes, user: str | None) -> Any:
        await _envd.remove(sb.workspace(), _rpc_decode(body, PathRequest).path, user)
        return {}

    # streams

    async def stream(self, name: str, sb: Sandbox, message: bytes, user: str | None, request: Request) -> Response:
        timeout_ms = request.headers.get("connect-timeout-ms", "")
        deadline = int(timeout_ms) / 1000 if timeout_ms.isdigit() and len(timeout_ms) <= 10 else None
        keepalive = request.headers.get("keepalive-ping-interval", "")
        ping = max(1, min(int(keepalive), 300)) if keepalive.isdigit() and len(keepalive) <= 4 else 50
        if name not in ("process.Process/Start", "process.Process/Connect", "filesystem.Filesystem/WatchDir"):
            raise RpcError(f"{name} is not implemented by this server", code="unimplemented")
        # Counted before anything starts (a refused Start runs no command), uncounted when the response ends.
        release = self.sandboxes.listener(sb)
        try:
            if name == "filesystem.Filesystem/WatchDir":
                req = _rpc_decode(message, WatchRequest)
                path = _envd.absolute(req.path)
                first = await _envd.watch_state(sb.workspace(), path, req.recursive, user)
                watch = self._watch_frames(sb, path, req.recursive, user, first, deadline, ping)
                return _Counted(release, watch, 200, media_type="application/connect+json")
            if name == "process.Process/Start":
                proc = await _envd.start(sb, _rpc_decode(message, StartRequest), user)
                kill_on_deadline = True
            else:
                proc = _envd.find_process(sb, _rpc_decode(message, ConnectRequest).process)
                kill_on_deadline = False
        except BaseException:
            release()
            raise

        async def frames() -> AsyncIterator[bytes]:
            events = _envd.listen(self.tg, sb, proc)
            try:
                async for frame in self._frames(sb, proc, events, deadline, ping, kill_on_deadline):
                    yield frame
            finally:
                events.close()

        return _Counted(release, frames(), 200, media_type="application/connect+json")

    async def _frames(
        self,
        sb: Sandbox,
        proc: Process,
        events: MemoryObjectReceiveStream[dict[str, Any] | None],
        deadline: float | None,
        ping: float,
        kill_on_deadline: bool,
    ) -> AsyncIterator[bytes]:
        yield envelope(_json.encode(start_event(proc.pid)))
        # No yield inside a cancel scope (an async generator may be suspended there): each wait is scoped alone.
        until = anyio.current_time() + deadline if deadline is not None else float("inf")
        error: RpcError | None = None
        ended = False
        while not ended:
            left = until - anyio.current_time()
            if left <= 0:
                error = RpcError("the command's timeout passed", code="deadline_exceeded")
                if kill_on_deadline and proc.exit_code is None:
                    with anyio.move_on_after(5, shield=True):
                        try:
                            await _envd.send_signal(sb, proc, "SIGNAL_SIGKILL")
                        except RpcError:
                            pass
                break
            event: dict[str, Any] | None = KEEPALIVE_EVENT
            with anyio.move_on_after(min(ping, left)) as idle:
                try:
                    event = await events.receive()
                except anyio.EndOfStream:
                    event = None
            if event is None:
                why = proc.lost or "sandbox paused or killed"
                error = RpcError(f"the stream of process {proc.pid} ended: {why}", code="unavailable")
                break
            if idle.cancelled_caught and anyio.current_time() >= until:
                continue
            ended = "end" in event["event"]
            yield envelope(_json.encode(event))
        yield end_stream(error)

    async def _watch_frames(
        self,
        sb: Sandbox,
        path: str,
        recursive: bool,
        user: str | None,
        state: dict[str, str],
        deadline: float | None,
        ping: float,
    ) -> AsyncIterator[bytes]:
        yield envelope(_json.encode({"start": {}}))
        until = anyio.current_time() + deadline if deadline is not None else float("inf")
        quiet_since = anyio.current_time()
        error: RpcError | None = None
        while anyio.current_time() < until:
            await anyio.sleep(min(_envd.WATCH_INTERVAL, max(0.0, until - anyio.current_time())))
            try:
                now = await _envd.watch_state(sb.workspace(), path, recursive, user)
            except RpcError as exc:
                error = exc
                break
            events = _envd.watch_events(state, now)
            state = now
            for event in events:
                yield envelope(_json.encode(event))
            if events:
                quiet_since = anyio.current_time()
            elif anyio.current_time() - quiet_since >= ping:
                quiet_since = anyio.current_time()
                yield envelope(_json.encode({"keepalive": {}}))
        else:
            error = RpcError("the watch's timeout passed", code="deadline_exceeded")
        yield end_stream(error)


class _Counted(StreamingResponse):
    """A stream that uncounts itself (``release``) when it ends, however: sent whole, never started, or cut by the
    client, which it notices at once (the ASGI ``http.disconnect``, or a send that fails) rather than when it next
    writes (a keepalive, 50 s apart): whatever the ASGI server's spec version (starlette listens for the disconnect
    only below 2.4). Its frames' generator is closed with it (its ``finally`` ends the listening)."""

    def __init__(self, release: Callable[[], None], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def gone() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(gone)
                with contextlib.suppress(OSError):  # ASGI 2.4: a send on a closed connection raises
                    await self.stream_response(send)
                tg.cancel_scope.cancel()
        finally:
            try:
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    with anyio.CancelScope(shield=True):
                        await close()
            finally:
                self._release()
