"""MCP both ways: ``WorkspaceServer`` serves workspaces' tools to any MCP client; ``MCPToolset`` turns any MCP
server's tools into Bunshin ``Tool``s.

The server. Every tool takes a ``workspace`` argument, a key the client chooses (a rollout id): the current
protocol (2026-07-28) has no sessions, so the client names the workspace explicitly and the first call with a new
key starts it. ``workspace_fork`` copies one live workspace under new keys (BunshinFork), ``workspace_close``
closes one; closing the server closes them all. Annotations come from the tools' effect classes: ``read`` and
``pure`` tools are ``readOnlyHint``, state-changing ones ``destructiveHint``, and none is ``openWorldHint``
(a workspace reaches nothing but its loopback). With a ``ToolCache`` the calls of each workspace go through a
``CachedSession`` (read hits, write hits by fork).

The client. ``Tool.from_mcp`` maps annotations conservatively, with MCP's defaults: a tool that does not say
``openWorldHint: false`` is ``external`` (never cached, never speculated), so an unannotated tool runs every time;
``readOnlyHint`` makes it a ``read`` (cached on the rollout's state chain). A state-changing tool of a server whose
state does *not* live in the rollout's workspace (``state_in_workspace=False``, the default) is marked
nondeterministic: forking the workspace cannot restore the server's state, so a write hit must not be served and
a write must not be speculated in a fork; it runs, and the chain moves to a state no other rollout shares.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any

import anyio
import msgspec
import xxhash

from .. import __version__
from .._cache._cache import CachedSession, ToolCache
from .._exceptions import (
    BunshinError,
    InvalidArgument,
    InvalidValue,
    ToolCallError,
    ToolError,
    ToolTimeout,
    WorkspaceClosed,
)
from .._host._kernel import Limits
from .._host._protocol import ExecResult
from .._images._image import Image
from .._tools._gui_tools import gui_tools
from .._tools._tools import Effect, Handler, Tool, builtin_tools, lookup
from .._workspace._facade import Workspace
from .._workspace._gui import Display, Screenshot
from ..agent import WorkspaceExecutor, observation
from ._require import require

require("mcp", framework="the MCP SDK", extra="mcp")

import mcp_types as types  # noqa: E402
from mcp import Client, MCPError, StdioServerParameters  # noqa: E402
from mcp.client._transport import Transport  # noqa: E402
from mcp.server import Server  # noqa: E402
from mcp.server.context import ServerRequestContext  # noqa: E402

__all__ = [
    "MCPImage",
    "MCPToolResult",
    "MCPToolset",
    "WorkspaceServer",
    "annotations_for",
    "serve",
]

#: A client's workspace key: 1-128 characters, letters, digits and ``_.:-``, starting with a letter or digit.
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
_KEY_SCHEMA = {
    "type": "string",
    "pattern": KEY_PATTERN.pattern,
    "description": "Key of the workspace to act on, chosen by the client (e.g. a rollout id); a new key starts one.",
}
_CLOSE = "workspace_close"
_FORK = "workspace_fork"

_Executor = CachedSession | WorkspaceExecutor


def annotations_for(tool: Tool) -> types.ToolAnnotations:
    """MCP hints from a tool's effect class. A tool with a per-call classifier (``bash``) is described by its
    static class, the worst case (``write``)."""
    read_only = tool.effect in (Effect.READ, Effect.PURE)
    return types.ToolAnnotations(
        title=tool.name,
        read_only_hint=read_only,
        destructive_hint=None if read_only else True,
        idempotent_hint=True if read_only else None,
        open_world_hint=tool.effect is Effect.EXTERNAL,
    )


def _with_key(schema: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(schema)
    out["properties"] = {"workspace": _KEY_SCHEMA, **dict(schema.get("properties") or {})}
    out["required"] = ["workspace", *[r for r in schema.get("required") or () if r != "workspace"]]
    return out


def _check_key(value: Any) -> str:
    if not isinstance(value, str) or KEY_PATTERN.fullmatch(value) is None:
        raise InvalidArgument(
            f"workspace must be a key matching {KEY_PATTERN.pattern}, not {value!r}", tool="workspace"
        )
    return value


def _text(text: str) -> types.TextContent:
    return types.TextContent(type="text", text=text)


def _render(result: Any) -> types.CallToolResult:
    """A tool's result as MCP content: screenshots as a PNG image, anything else as the text ``run_agent``'s model
    sees (``agent.observation``, unclipped), commands also structured."""
    if isinstance(result, Screenshot):
        image = types.ImageContent(type="image", data=base64.b64encode(result.png).decode(), mime_type="image/png")
        meta = {"width": result.width, "height": result.height, "digest": result.digest}
        return types.CallToolResult(content=[image], structured_content=meta)
    text = _text(observation(result, max_chars=1 << 62).output)
    structured = msgspec.to_builtins(result) if isinstance(result, ExecResult) else None
    return types.CallToolResult(content=[text], structured_content=structured)


def _error(exc: BunshinError) -> types.CallToolResult:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ToolTimeout):
        text += f"\n{exc.stdout}{exc.stderr}"
    return types.CallToolResult(content=[_text(text)], is_error=True)


class WorkspaceServer:
    """An MCP server whose tools act on Bunshin workspaces keyed by the client (see the module doc).

    ``tools`` defaults to the built-in tools, plus the GUI tools when ``display`` is set (every workspace then
    gets a virtual display). ``max_workspaces`` bounds the live workspaces; a call past it is an error result.
    ``server`` is the ``mcp`` low-level ``Server``: pass it to ``mcp.Client`` in process, or use ``run_stdio`` /
    ``run_http``. Use as ``async with WorkspaceServer() as srv``; ``aclose()`` closes every workspace.
    """

    def __init__(
        self,
        *,
        image: Image | None = None,
        limits: Limits | None = None,
        display: Display | bool | None = None,
        env: Mapping[str, str] | None = None,
        tools: Iterable[Tool] | None = None,
        cache: ToolCache | None = None,
        max_workspaces: int = 32,
        name: str = "bunshin",
    ) -> None:
        if max_workspaces < 1:
            raise InvalidValue("max_workspaces must be at least 1", argument="max_workspaces")
        if tools is None:
            tools = [*builtin_tools(), *(gui_tools() if display else [])]
        self.tools: dict[str, Tool] = {t.name: t for t in tools}
        for reserved in (_CLOSE, _FORK):
            if reserved in self.tools:
                raise InvalidValue(f"{reserved} is a tool name of the server itself", argument="tools")
        self.image = image
        self.limits = limits
        self.display = display
        self.env = dict(env or {})
        self.cache = cache
        self.max_workspaces = max_workspaces
        self._entries: dict[str, _Executor] = {}
        self._starting: dict[str, anyio.Event] = {}
        self._closed = False
        self.server: Server[Any] = Server(
            name,
            version=__version__,
            instructions="Every tool takes `workspace`, a key you choose; a new key starts a fresh Linux workspace.",
            on_list_tools=self._on_list_tools,
            on_call_tool=self._on_call_tool,
        )

    # ------------------------------------------------------------------------------------------ tools

    def mcp_tools(self) -> list[types.Tool]:
        """The tools as this server lists them."""
        out = [
            types.Tool(
                name=t.name,
                description=t.description,
                input_schema=_with_key(t.schema),
                annotations=annotations_for(t),
            )
            for t in self.tools.values()
        ]
        out.append(
            types.Tool(
                name=_FORK,
                description="Fork a live workspace (processes, memory, files) into new workspaces under new keys.",
                input_schema=_with_key(
                    {
                        "type": "object",
                        "properties": {"into": {"type": "array", "items": _KEY_SCHEMA, "minItems": 1}},
                        "required": ["into"],
                        "additionalProperties": False,
                    }
                ),
                annotations=types.ToolAnnotations(
                    title=_FORK, read_only_hint=False, destructive_hint=False, open_world_hint=False
                ),
            )
        )
        out.append(
            types.Tool(
                name=_CLOSE,
                description="Close a workspace and free everything it holds.",
                input_schema=_with_key({"type": "object", "properties": {}, "additionalProperties": False}),
                annotations=types.ToolAnnotations(
                    title=_CLOSE,
                    read_only_hint=False,
                    destructive_hint=True,
                    idempotent_hint=True,
                    open_world_hint=False,
                ),  # fmt: skip
            )
        )
        return out

    async def _on_list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.mcp_tools())

    async def _on_call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        return await self.call(params.name, params.arguments or {})

    async def call(self, name: str, arguments: Mapping[str, Any]) -> types.CallToolResult:
        """Serve one ``tools/call``. Tool failures (``BunshinError``) are error results the model can read; an
        unknown tool is a protocol error (``MCPError``)."""
        if name not in (_CLOSE, _FORK):
            try:
                lookup(self.tools, name)
            except ToolCallError as exc:
                raise MCPError(types.INVALID_PARAMS, str(exc)) from exc
        args = dict(arguments)
        try:
            key = _check_key(args.pop("workspace", None))
            if name == _CLOSE:
                closed = await self.close_workspace(key)
                return types.CallToolResult(content=[_text("closed" if closed else f"no workspace {key!r}")])
            if name == _FORK:
                into = args.get("into")
                if not isinstance(into, list) or not into or set(args) != {"into"}:
                    raise InvalidArgument("into must be a non-empty list of new workspace keys", tool=_FORK)
                await self.fork(key, [_check_key(k) for k in into])
                return types.CallToolResult(content=[_text(f"forked {key!r} into {', '.join(into)}")])
            executor = await self._executor(key)
            return _render(await executor.call(name, args))
        except BunshinError as exc:
            return _error(exc)

    # ------------------------------------------------------------------------------------------ workspaces

    @property
    def keys(self) -> list[str]:
        """Keys of the live workspaces."""
        return list(self._entries)

    def workspace(self, key: str) -> Workspace:
        """The live workspace of ``key`` (after a cached write hit, the fork it continues in)."""
        executor = self._entries.get(key)
        if executor is None:
            raise InvalidArgument(f"no workspace {key!r}", tool="workspace")
        return executor.workspace

    def _wrap(self, ws: Workspace, salt: str = "") -> _Executor:
        tools = self.tools.values()
        if self.cache is not None:
            return self.cache.session(ws, tools, salt=salt, own=True)
        return WorkspaceExecutor(ws, tools, own=True)

    def _reserve(self, keys: Sequence[str]) -> anyio.Event:
        if self._closed:
            raise WorkspaceClosed("the MCP server is closing", workspace_id=keys[0])
        taken = [k for k in keys if k in self._entries or k in self._starting]
        if taken or len(set(keys)) != len(keys):
            raise InvalidArgument(f"workspace keys already in use or repeated: {taken or list(keys)}", tool=_FORK)
        if len(self._entries) + len(self._starting) + len(keys) > self.max_workspaces:
            raise InvalidArgument(
                f"this server keeps at most {self.max_workspaces} workspaces; close some first", tool="workspace"
            )
        event = anyio.Event()
        for k in keys:
            self._starting[k] = event
        return event

    async def _executor(self, key: str) -> _Executor:
        while True:
            executor = self._entries.get(key)
            if executor is not None:
                return executor
            pending = self._starting.get(key)
            if pending is None:
                break
            await pending.wait()
        event = self._reserve([key])
        try:
            ws = Workspace(self.image, limits=self.limits, display=self.display, env=self.env)
            await ws.start()  # on failure or cancellation it removes what it made
            await self._register({key: ws})
            return self._entries[key]
        finally:
            del self._starting[key]
            event.set()

    async def _register(self, made: Mapping[str, Workspace], salt: str = "") -> None:
        if self._closed:  # closed while these started: nobody else will close them
            with anyio.CancelScope(shield=True):
                for ws in made.values():
                    await ws.aclose()
            raise WorkspaceClosed("the MCP server closed", workspace_id=next(iter(made)))
        for key, ws in made.items():
            self._entries[key] = self._wrap(ws, salt)

    async def fork(self, key: str, into: Sequence[str]) -> None:
        """Fork the workspace of ``key`` into new workspaces under the keys ``into``."""
        source = self.workspace(key)
        event = self._reserve(into)
        try:
            copies = await source.fork(len(into))
            # A cached copy's state chain cannot be named from its parent's session: a salt of its own keeps it
            # from serving (or being served) entries it does not match.
            await self._register(dict(zip(into, copies, strict=True)), salt=f"fork:{copies[0].id}")
        finally:
            for k in into:
                del self._starting[k]
            event.set()

    async def close_workspace(self, key: str) -> bool:
        """Close ``key``'s workspace; False if there is none. Idempotent."""
        executor = self._entries.pop(key, None)
        if executor is None:
            return False
        with anyio.CancelScope(shield=True):
            await executor.aclose()
        return True

    async def aclose(self) -> None:
        """Close every workspace (shielded: a cancelled shutdown still frees them). Idempotent."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            while self._starting:
                await next(iter(self._starting.values())).wait()
            while self._entries:
                await self.close_workspace(next(iter(self._entries)))

    async def __aenter__(self) -> WorkspaceServer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------------------------------ transports

    async def run_stdio(self) -> None:
        """Serve one client over this process's stdin/stdout until it closes them; then close every workspace."""
        from mcp.server.stdio import stdio_server

        try:
            async with stdio_server() as (read_stream, write_stream):
                await self.server.run(read_stream, write_stream, self.server.create_initialization_options())
        finally:
            await self.aclose()

    async def run_http(self, *, host: str = "127.0.0.1", port: int = 8000, path: str = "/mcp") -> None:
        """Serve streamable HTTP on ``host:port`` at ``path`` (uvicorn) until cancelled, SIGTERM or SIGINT; then
        close every workspace. A non-loopback ``host`` exposes root-run workspaces to whoever reaches it: put
        authentication in front."""
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                # uvicorn re-raises a caught SIGTERM once it has stopped, killing the process before the
                # workspaces are closed: the signals are ours (below).
                yield

        app = self.server.streamable_http_app(streamable_http_path=path, host=host)
        http = Quiet(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        try:
            async with anyio.create_task_group() as tg:

                async def stop_on_signal() -> None:
                    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for _ in signals:
                            http.should_exit = True  # a graceful stop: requests in flight finish
                            return

                tg.start_soon(stop_on_signal)
                try:
                    await http.serve()
                finally:
                    tg.cancel_scope.cancel()
        finally:
            await self.aclose()


async def serve(server: WorkspaceServer, transport: str = "stdio", **http: Any) -> None:
    """Run ``server`` over ``transport`` (``stdio`` or ``http``, whose keywords are ``run_http``'s) until the
    client leaves, SIGTERM or SIGINT; every workspace is closed on the way out."""
    if transport == "http":
        await server.run_http(**http)
        return
    if transport != "stdio":
        raise InvalidArgument(f"transport must be stdio or http, not {transport!r}", tool="mcp serve")
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()

        async def run() -> None:
            try:
                await server.run_stdio()
            finally:
                tg.cancel_scope.cancel()

        tg.start_soon(stop_on_signal)
        tg.start_soon(run)
    await server.aclose()


# ---------------------------------------------------------------------------------------------- the client side


class MCPImage(msgspec.Struct, frozen=True):
    """An image a tool returned (a GUI screenshot), as MCP image content."""

    mime_type: str
    data: bytes


class MCPToolResult(msgspec.Struct, frozen=True):
    """What an MCP tool returned: its text blocks joined by newlines, its structured content, its images."""

    text: str
    structured: Any = None
    images: list[MCPImage] = msgspec.field(default_factory=list)


def _result(name: str, res: types.CallToolResult) -> MCPToolResult:
    texts: list[str] = []
    images: list[MCPImage] = []
    for block in res.content:
        if isinstance(block, types.TextContent):
            texts.append(block.text)
        elif isinstance(block, types.ImageContent):
            images.append(MCPImage(block.mime_type, base64.b64decode(block.data)))
        else:
            texts.append(json.dumps(block.model_dump(by_alias=True, mode="json", exclude_none=True)))
    text = "\n".join(texts)
    if res.is_error:
        raise ToolError(f"{name}: {text or 'the tool failed'}", tool=name)
    return MCPToolResult(text, res.structured_content, images)


ServerSpec = Client | Server[Any] | Transport | StdioServerParameters | str


class MCPToolset:
    """The tools of one MCP server as Bunshin ``Tool``s (``toolset.tools``), for ``ToolCache.session``,
    ``run_agent`` or ``WorkspaceExecutor``; their cache and speculation policy follows their annotations (module
    doc). Use as ``async with MCPToolset("http://host:8000/mcp") as toolset``.

    ``server`` is anything ``mcp.Client`` connects to (a URL, ``StdioServerParameters``, a ``Transport``, an
    in-process ``Server``) or a ``Client`` the caller has entered and keeps owning. ``prefix`` is put before every
    tool name (two servers with a ``search`` tool). ``state_in_workspace=True`` says the server's state lives in the
    rollout's workspace (a server started inside it), so writes may be served by fork and speculated. Every tool's
    cache version includes the server's name and version and a digest of the tool's description, schema and
    annotations, so entries of a changed tool are never served. ``timeout`` (seconds) bounds each call.
    """

    def __init__(
        self,
        server: ServerSpec,
        *,
        prefix: str = "",
        state_in_workspace: bool = False,
        version: str = "1",
        timeout: float | None = None,
    ) -> None:
        self._server = server
        self.prefix = prefix
        self.state_in_workspace = state_in_workspace
        self.version = version
        self.timeout = timeout
        self.tools: list[Tool] = []
        self._client: Client | None = server if isinstance(server, Client) else None
        self._stack = AsyncExitStack()

    @property
    def client(self) -> Client:
        if self._client is None:
            raise ToolError("the MCP toolset is not open (use `async with`)", tool="mcp")
        return self._client

    async def __aenter__(self) -> MCPToolset:
        try:
            if self._client is None:
                self._client = await self._stack.enter_async_context(
                    Client(self._server, read_timeout_seconds=self.timeout)  # type: ignore[arg-type]
                )
            self.tools = await self._load()
        except BaseException as exc:
            # Not in a shielded scope of ours: the client's task group must exit in the scope it was entered in.
            await self._stack.aclose()
            if isinstance(exc, MCPError | OSError):
                raise ToolError(f"cannot list the MCP server's tools: {exc}", tool="mcp") from exc
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Disconnect (and stop a stdio server) unless the caller passed its own ``Client``. Idempotent."""
        await self._stack.aclose()

    async def _load(self) -> list[Tool]:
        client = self.client
        info = client.server_info
        origin = f"{info.name}@{info.version}" if info is not None else "mcp"
        listed: list[types.Tool] = []
        cursor: str | None = None
        for _ in range(1000):
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        return [self._tool(t, origin) for t in listed]

    def _tool(self, spec: types.Tool, origin: str) -> Tool:
        # by_alias: the wire names (readOnlyHint, inputSchema); a plain dump says read_only_hint, which
        # Tool.from_mcp would not see, and every tool would look unannotated.
        wire = spec.model_dump(by_alias=True, mode="json", exclude_none=True)
        digest = xxhash.xxh3_64_hexdigest(
            msgspec.json.encode(
                [wire.get("description"), wire.get("inputSchema"), wire.get("annotations")], order="deterministic"
            )
        )
        tool = Tool.from_mcp(
            {**wire, "name": self.prefix + spec.name},
            self._handler(spec.name),
            version=f"{self.version}:{origin}:{digest}",
            result_type=MCPToolResult,
        )
        if tool.effect is Effect.WRITE and not self.state_in_workspace:
            tool = tool.with_effect(Effect.WRITE, deterministic=False)
        return tool

    def _handler(self, name: str) -> Handler:
        call: Callable[..., Any] = self.client.call_tool
        timeout = self.timeout

        async def handler(ws: Workspace, args: dict[str, Any]) -> MCPToolResult:
            try:
                res = await call(name, args, read_timeout_seconds=timeout)
            except MCPError as exc:
                raise ToolError(f"{name}: {exc.error.message}", tool=name) from exc
            except TimeoutError as exc:
                raise ToolTimeout(f"{name}: no answer within {timeout} s", tool=name, timeout=timeout or 0.0) from exc
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError) as exc:
                raise ToolError(f"{name}: the MCP connection is gone ({exc!r})", tool=name) from exc
            return _result(name, res)

        return handler
