"""The ASGI app: E2B's control plane and envd on one port (starlette).

Every control-plane request must carry the server's API key (``X-API-KEY``, compared in constant time); every envd
request names its sandbox (``E2b-Sandbox-Id``) and carries that sandbox's access token (``X-Access-Token``), which
only the control plane hands out. Clients are untrusted like workspaces: ids are validated, request bodies are read
up to a bound (``MAX_BODY``; uploads ``MAX_UPLOAD``), a stream's request is one bounded message.
"""

from __future__ import annotations

import base64
import hmac
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from anyio.abc import TaskGroup
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from .._exceptions import BunshinError, InvalidArgument
from . import _envd
from ._rpc import EnvdRpc, rpc_error
from ._sandboxes import Sandbox, Sandboxes, valid_id
from ._templates import BuildStart, TemplateRequest, run_build
from ._wire import (
    MAX_MESSAGE,
    ApiError,
    ConnectSandbox,
    ForkRequest,
    NewSandbox,
    RpcError,
    SnapshotRequest,
    TimeoutRequest,
    unenvelope,
)

MAX_BODY = 1 << 20
"""Largest control-plane or unary envd request body."""
_json = msgspec.json.Encoder()


class _TooLarge(Exception):
    pass


def _api_error(status: int, message: str) -> Response:
    return JSONResponse({"code": status, "message": message}, status_code=status)


async def _pieces(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request body as it arrives; ``_TooLarge`` once it passes ``limit`` bytes (or declares more)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _TooLarge
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise _TooLarge
        yield chunk


async def _body(request: Request, limit: int = MAX_BODY) -> bytes:
    return b"".join([chunk async for chunk in _pieces(request, limit)])


async def _file_pieces(upload: UploadFile) -> AsyncIterator[bytes]:
    while piece := await upload.read(_envd.UPLOAD_CHUNK):
        yield piece


def _decode(data: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(data or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(f"invalid request: {exc}", status=400) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(f"invalid JSON: {exc}", status=400) from exc


def _limited(receive: Receive, limit: int) -> Receive:
    """``receive`` that fails once the body passes ``limit`` bytes (a multipart upload is parsed as it arrives)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge
        return message

    return wrapped


class E2BApp:
    """The ASGI app over ``sandboxes``; pumps of command output run in ``tg`` (the server's task group)."""

    def __init__(self, sandboxes: Sandboxes, api_key: str, tg: TaskGroup) -> None:
        self.sandboxes = sandboxes
        self.api_key = api_key
        self.tg = tg
        control: list[tuple[str, str, Callable[..., Awaitable[Response]]]] = [
            ("/v2/sandboxes", "POST", self.create),
            ("/sandboxes", "POST", self.create),
            ("/v2/sandboxes", "GET", self.list_sandboxes),
            ("/sandboxes", "GET", self.list_sandboxes),
            ("/sandboxes/{sandbox_id}", "GET", self.info),
            ("/sandboxes/{sandbox_id}", "DELETE", self.kill),
            ("/sandboxes/{sandbox_id}/timeout", "POST", self.timeout),
            ("/sandboxes/{sandbox_id}/refreshes", "POST", self.refresh),
            ("/sandboxes/{sandbox_id}/pause", "POST", self.pause),
            ("/v2/sandboxes/{sandbox_id}/connect", "POST", self.connect),
            ("/sandboxes/{sandbox_id}/connect", "POST", self.connect),
            ("/sandboxes/{sandbox_id}/resume", "POST", self.connect),
            ("/sandboxes/{sandbox_id}/fork", "POST", self.fork),
            ("/sandboxes/{sandbox_id}/snapshots", "POST", self.snapshot),
            ("/snapshots", "GET", self.list_snapshots),
            ("/templates/{template_id:path}", "DELETE", self.delete_snapshot),
            ("/v3/templates", "POST", self.request_build),
            ("/v2/templates/{template_id}/builds/{build_id}", "POST", self.start_build),
            ("/templates/{template_id}/builds/{build_id}/status", "GET", self.build_status),
            ("/templates/{template_id}/files/{files_hash}", "GET", self.template_files),
            ("/templates/aliases/{alias:path}", "GET", self.template_alias),
            ("/v2/templates", "POST", self.templates),
            ("/templates", "POST", self.templates),
        ]
        routes = [Route(path, self._api(handler), methods=[method]) for path, method, handler in control]
        routes += [
            Route("/health", self._envd_http(self.health), methods=["GET"]),
            Route("/files", self._envd_http(self.read_file), methods=["GET"]),
            Route("/files", self._envd_http(self.write_files), methods=["POST"]),
            Route("/{service:str}/{method:str}", self.rpc, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)
        self._rpc = EnvdRpc(sandboxes, tg)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    # ------------------------------------------------------------------------------------------------ control plane

    def _api(self, handler: Callable[..., Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            key = request.headers.get("x-api-key", "")
            if not hmac.compare_digest(key.encode(), self.api_key.encode()):
                return _api_error(401, "invalid API key")
            for name in ("sandbox_id",):
                value = request.path_params.get(name)
                if value is not None and not valid_id(value):
                    return _api_error(404, f"sandbox {value[:80]!r} not found")
            try:
                return await handler(request)
            except _TooLarge:
                return _api_error(413, "request body too large")
            except ApiError as exc:
                return _api_error(exc.status, exc.message)
            except RpcError as exc:  # a sandbox's workspace is not there: paused (or being killed)
                return _api_error(409, exc.message)
            except InvalidArgument as exc:  # what the client sent (a new sandbox's environment, ...)
                return _api_error(400, f"{type(exc).__name__}: {exc}")
            except BunshinError as exc:
                return _api_error(500, f"{type(exc).__name__}: {exc}")

        return endpoint

    async def create(self, request: Request) -> Response:
        req = _decode(await _body(request), NewSandbox)
        sb = await self.sandboxes.create(req)
        return Response(_json.encode(sb.created()), 201, media_type="application/json")

    async def list_sandboxes(self, request: Request) -> Response:
        metadata: dict[str, str] = {}
        raw = request.query_params.get("metadata")
        if raw:
            metadata = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in urllib.parse.parse_qsl(raw)}
        state = request.query_params.get("state")
        states = set(state.split(",")) if state else None
        if request.url.path == "/sandboxes":
            states = {"running"}
        found = [sb.detail() for sb in self.sandboxes.matching(metadata, states)]
        return Response(_json.encode(found), 200, media_type="application/json")

    async def info(self, request: Request) -> Response:
        sb = self.sandboxes.get(request.path_params["sandbox_id"])
        return Response(_json.encode(sb.detail()), 200, media_type="application/json")

    async def kill(self, request: Request) -> Response:
        await self.sandboxes.kill(request.path_params["sandbox_id"])
        return Response(status_code=204)

    async def timeout(self, request: Request) -> Response:
        req = _decode(await _body(request), TimeoutRequest)
        self.sandboxes.get(request.path_params["sandbox_id"]).set_timeout(req.timeout)
        return Response(status_code=204)

    async def refresh(self, request: Request) -> Response:
        self.sandboxes.get(request.path_params["sandbox_id"])
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        if not await self.sandboxes.pause(request.path_params["sandbox_id"]):
            return _api_error(409, "sandbox is already paused")
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        req = _decode(await _body(request), ConnectSandbox)
        sb = self.sandboxes.get(request.path_params["sandbox_id"])
        resumed = sb.state == "paused"
        sb = await self.sandboxes.connect(sb.id, req.timeout)
        return Response(_json.encode(sb.created()), 201 if resumed else 200, media_type="application/json")

    async def fork(self, request: Request) -> Response:
        req = _decode(await _body(request), ForkRequest)
        results = await self.sandboxes.fork(request.path_params["sandbox_id"], req.count, req.timeout)
        body = [
            {"sandbox": r.created()} if isinstance(r, Sandbox) else {"error": {"code": r.status, "message": r.message}}
            for r in results
        ]
        return Response(_json.encode(body), 201, media_type="application/json")

    async def snapshot(self, request: Request) -> Response:
        req = _decode(await _body(request), SnapshotRequest)
        out = await self.sandboxes.create_snapshot(request.path_params["sandbox_id"], req.name)
        return Response(_json.encode(out), 201, media_type="application/json")

    async def list_snapshots(self, request: Request) -> Response:
        found = self.sandboxes.snapshots(request.query_params.get("sandboxID"))
        return Response(_json.encode(found), 200, media_type="application/json")

    async def delete_snapshot(self, request: Request) -> Response:
        if not await self.sandboxes.delete_snapshot(request.path_params["template_id"]):
            return _api_error(404, "snapshot not found")
        return Response(status_code=204)

    async def request_build(self, request: Request) -> Response:
        req = _decode(await _body(request), TemplateRequest)
        build = self.sandboxes.request_build(req.name, req.tags or [])
        body = {
            "templateID": build.template_id,
            "buildID": build.build_id,
            "public": False,
            "names": [build.name],
            "tags": [a.partition(":")[2] for a in build.aliases if ":" in a],
            "aliases": [build.name],
        }
        return Response(_json.encode(body), 202, media_type="application/json")

    async def start_build(self, request: Request) -> Response:
        build = self.sandboxes.builds(request.path_params["template_id"])
        if build.build_id != request.path_params["build_id"] or build.status != "waiting":
            return _api_error(400, "no such build waiting to start")
        start = _decode(await _body(request), BuildStart)
        self.tg.start_soon(run_build, self.sandboxes, build, start)
        return Response(status_code=202)

    async def build_status(self, request: Request) -> Response:
        build = self.sandboxes.builds(request.path_params["template_id"])
        if build.build_id != request.path_params["build_id"]:
            return _api_error(404, "no such build")
        offset = request.query_params.get("logsOffset", "0")
        body = build.status_body(int(offset) if offset.isdigit() and len(offset) < 10 else 0)
        return Response(_json.encode(body), 200, media_type="application/json")

    async def template_files(self, request: Request) -> Response:
        return _api_error(
            400,
            "COPY steps are not served by bunshin e2b: write files in a RUN step, or bake them into the image you "
            "import with `bunshin image import`",
        )

    async def template_alias(self, request: Request) -> Response:
        out = self.sandboxes.template(request.path_params["alias"])
        if out is None:
            return _api_error(404, "template alias not found")
        return Response(_json.encode({"templateID": out, "public": False}), 200, media_type="application/json")

    async def templates(self, request: Request) -> Response:
        return _api_error(
            501,
            "template builds are not served by bunshin e2b: import the image with `bunshin image import REF "
            "--name NAME` and create sandboxes with template=NAME",
        )

    # ------------------------------------------------------------------------------------------------ envd

    def _sandbox(self, request: Request) -> Sandbox | Response:
        """The sandbox an envd request is for, or the answer E2B's proxy gives (401, or 502 "not found")."""
        sandbox_id = request.headers.get("e2b-sandbox-id", "")
        try:
            sb = self.sandboxes.get(sandbox_id)
        except ApiError:
            return _api_error(502, f"The sandbox {sandbox_id[:80]!r} was not found")
        token = request.headers.get("x-access-token", "")
        if not hmac.compare_digest(token.encode(), sb.token.encode()):
            return _api_error(401, "invalid or missing X-Access-Token for this sandbox")
        return sb

    def _envd_http(
        self, handler: Callable[[Request, Sandbox], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            sb = self._sandbox(request)
            if isinstance(sb, Response):
                return sb
            try:
                return await handler(request, sb)
            except _TooLarge:
                return _api_error(413, "request body too large")
            except ClientDisconnect:  # gone mid-request (what it started was undone): nobody reads an answer
                return Response(status_code=499)
            except RpcError as exc:
                status = {"not_found": 404, "invalid_argument": 400, "resource_exhausted": 507}.get(exc.code, 500)
                if exc.code == "unavailable":
                    status = 502
                return _api_error(status, exc.message)

        return endpoint

    async def health(self, request: Request, sb: Sandbox) -> Response:
        if sb.ws is None:
            return _api_error(502, f"sandbox {sb.id} is paused: its port is not open")
        return Response(status_code=204)

    async def read_file(self, request: Request, sb: Sandbox) -> Response:
        user = _envd.user_from(_basic_or_param(request))
        data = await _envd.read(sb.workspace(), request.query_params.get("path", ""), user)
        return Response(data, 200, media_type="application/octet-stream")

    async def write_files(self, request: Request, sb: Sandbox) -> Response:
        """Every file of the request or none (``_envd.Upload``): one past the limit, a client that goes away or a
        file that cannot be written leaves no file of the request behind."""
        user = _envd.user_from(_basic_or_param(request))
        written = []
        async with _envd.Upload(sb.workspace(), user) as upload:
            if request.headers.get("content-type", "").startswith("application/octet-stream"):
                if request.headers.get("content-encoding"):
                    raise RpcError("compressed uploads are not supported", code="invalid_argument")
                data = _pieces(request, _envd.MAX_UPLOAD)
                written.append(await upload.add(request.query_params.get("path", ""), data))
            else:
                limited = Request(request.scope, _limited(request.receive, _envd.MAX_UPLOAD))
                async with limited.form(max_files=1000, max_fields=1000) as form:
                    for key, value in form.multi_items():
                        if key != "file" or isinstance(value, str):
                            continue
                        path = request.query_params.get("path") or value.filename or ""
                        written.append(await upload.add(path, _file_pieces(value)))
            await upload.commit()
        return Response(_json.encode(written), 200, media_type="application/json")

    async def rpc(self, request: Request) -> Response:
        """A Connect call: unary (``application/json``) or a server stream (``application/connect+json``)."""
        name = f"{request.path_params['service']}/{request.path_params['method']}"
        streaming = request.headers.get("content-type", "").startswith("application/connect+")
        sb = self._sandbox(request)
        if isinstance(sb, Response):
            return sb
        try:
            body = await _body(request, MAX_MESSAGE + 5)
        except _TooLarge:
            return rpc_error(RpcError("request message too large", code="resource_exhausted"), streaming)
        try:
            user = _envd.user_from(request.headers.get("authorization"))
            if streaming:
                return await self._rpc.stream(name, sb, unenvelope(body), user, request)
            handler = self._rpc.unary.get(name)
            if handler is None:
                raise RpcError(f"{name} is not implemented by this server", code="unimplemented")
            answer = await handler(sb, body, user)
            return Response(_json.encode(answer), 200, media_type="application/json")
        except RpcError as exc:
            return rpc_error(exc, streaming)


def _basic_or_param(request: Request) -> str | None:
    """/files names its user in ``username`` (older SDKs) or in Basic authorization."""
    user = request.query_params.get("username")
    if user:
        return "Basic " + base64.b64encode(f"{user}:".encode()).decode()
    return request.headers.get("authorization")
