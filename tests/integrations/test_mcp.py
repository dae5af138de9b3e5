"""The MCP integration through the real ``mcp`` SDK: its ``Client`` in process, over a stdio subprocess
(``bunshin mcp serve``) and over streamable HTTP."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import mcp
import mcp_types as types
import pytest
from mcp import StdioServerParameters
from mcp.server.mcpserver import MCPServer

from bunshin_async import ToolError, Workspace
from bunshin_async.cache import ToolCache
from bunshin_async.integrations.mcp import MCPToolResult, MCPToolset, WorkspaceServer, annotations_for
from bunshin_async.tools import Effect

from .conftest import Clean, bunshin_env, free_port

BUNSHIN = str(Path(sys.executable).with_name("bunshin"))


def _text(res: types.CallToolResult) -> str:
    return "\n".join(b.text for b in res.content if isinstance(b, types.TextContent))


def _hints(tool: types.Tool) -> dict[str, Any]:
    assert tool.annotations is not None, tool.name
    return tool.annotations.model_dump(by_alias=True, exclude_none=True)


def _check_listing(tools: list[types.Tool]) -> None:
    by_name = {t.name: t for t in tools}
    assert {"bash", "read_file", "write_file", "list_dir", "python", "workspace_fork", "workspace_close"} <= set(
        by_name
    )
    for t in tools:
        assert _hints(t)["openWorldHint"] is False, t.name  # a workspace reaches only its loopback
        assert "workspace" in t.input_schema["required"]
    for name in ("read_file", "list_dir"):
        assert _hints(by_name[name])["readOnlyHint"] is True
        assert "destructiveHint" not in _hints(by_name[name])
    for name in ("bash", "write_file", "python"):
        assert _hints(by_name[name]) | {"title": None} == {
            "title": None,
            "readOnlyHint": False,
            "destructiveHint": True,
            "openWorldHint": False,
        }


async def test_in_process_client_keys_workspaces_and_survives_the_round_trip() -> None:
    async with WorkspaceServer() as srv, mcp.Client(srv.server) as client:
        _check_listing((await client.list_tools()).tools)
        r = await client.call_tool("write_file", {"workspace": "a", "path": "x.txt", "content": "from a\n"})
        assert not r.is_error, _text(r)
        r = await client.call_tool("bash", {"workspace": "a", "command": "cat x.txt; echo $((6*7))"})
        assert not r.is_error and "from a\n42" in _text(r)
        assert r.structured_content["exit_code"] == 0
        # Another key is another workspace.
        r = await client.call_tool("read_file", {"workspace": "b", "path": "x.txt"})
        assert r.is_error and "FileNotFound" in _text(r)
        assert sorted(srv.keys) == ["a", "b"]
        # A fork carries files and processes; copies are isolated from each other and from the parent.
        await client.call_tool("bash", {"workspace": "a", "command": "sleep 300 >/dev/null 2>&1 &"})
        r = await client.call_tool("workspace_fork", {"workspace": "a", "into": ["a1", "a2"]})
        assert not r.is_error, _text(r)
        await client.call_tool("write_file", {"workspace": "a1", "path": "x.txt", "content": "from a1\n"})
        for key, want in (("a", "from a\n"), ("a1", "from a1\n"), ("a2", "from a\n")):
            r = await client.call_tool("read_file", {"workspace": key, "path": "x.txt"})
            assert _text(r) == want, key
        r = await client.call_tool("bash", {"workspace": "a2", "command": "pgrep -x sleep >/dev/null && echo up"})
        assert "up" in _text(r)
        # Bad input: clear error results, nothing started for them.
        for bad in ({"workspace": "../etc", "command": "true"}, {"command": "true"}, {"workspace": "", "command": ""}):
            r = await client.call_tool("bash", bad)
            assert r.is_error and "InvalidArgument" in _text(r), bad
        r = await client.call_tool("workspace_fork", {"workspace": "a", "into": ["a1"]})
        assert r.is_error and "already in use" in _text(r)
        r = await client.call_tool("read_file", {"workspace": "a", "path": "/etc/passwd"})
        assert r.is_error and "PathOutsideWorkspace" in _text(r)
        assert sorted(srv.keys) == ["a", "a1", "a2", "b"]
        r = await client.call_tool("workspace_close", {"workspace": "b"})
        assert _text(r) == "closed" and "b" not in srv.keys
    assert srv.keys == []


async def test_limit_on_workspaces_and_unknown_tool() -> None:
    async with WorkspaceServer(max_workspaces=1) as srv, mcp.Client(srv.server) as client:
        assert not (await client.call_tool("bash", {"workspace": "one", "command": "true"})).is_error
        r = await client.call_tool("bash", {"workspace": "two", "command": "true"})
        assert r.is_error and "at most 1" in _text(r)
        with pytest.raises(mcp.MCPError, match="unknown tool"):
            await client.call_tool("no_such_tool", {"workspace": "one"})


async def test_cancelled_call_and_timeout_leave_no_workspace(clean: Clean) -> None:
    async with WorkspaceServer() as srv, mcp.Client(srv.server) as client:
        with anyio.move_on_after(1.0) as scope:
            await client.call_tool("bash", {"workspace": "slow", "command": "sleep 60"})
        assert scope.cancelled_caught
        # A workspace being started when the caller gives up: it is removed again or registered and closed below.
        with anyio.move_on_after(0.01):
            await client.call_tool("bash", {"workspace": "starting", "command": "true"})
    assert srv.keys == []
    await clean()


async def test_toolset_caches_read_only_tools_and_never_unannotated_ones() -> None:
    counted: dict[str, int] = {"plain": 0}
    other = MCPServer("other")

    @other.tool()
    def plain(x: int) -> str:
        """An unannotated tool: MCP says it may be open-world and may change anything."""
        counted["plain"] += 1
        return f"plain {x} #{counted['plain']}"

    async with WorkspaceServer() as srv, ToolCache() as cache, Workspace() as ws:
        async with MCPToolset(srv.server) as bunshin_tools, MCPToolset(other, prefix="o_") as other_tools:
            effects = {t.name: (t.effect, t.deterministic) for t in bunshin_tools.tools + other_tools.tools}
            assert effects["read_file"] == (Effect.READ, True)
            assert effects["bash"] == (Effect.WRITE, False)  # the server's state is not this workspace's
            assert effects["o_plain"][0] is Effect.EXTERNAL
            tools = bunshin_tools.tools + other_tools.tools
            async with cache.session(ws, tools) as s1, cache.session(ws, tools) as s2:
                await s1.call("write_file", {"workspace": "k", "path": "n.txt", "content": "v1"})
                first = await s1.call_ex("read_file", {"workspace": "k", "path": "n.txt"})
                assert first.source == "executed" and isinstance(first.result, MCPToolResult)
                assert first.result.text == "v1"
                again = await s1.call_ex("read_file", {"workspace": "k", "path": "n.txt"})
                assert again.source == "cache" and again.result == first.result
                # A sibling at the same state (no write yet in its chain) misses the first session's read.
                sib = await s2.call_ex("read_file", {"workspace": "k", "path": "n.txt"})
                assert sib.source == "executed"
                sib2 = await s2.call_ex("read_file", {"workspace": "k", "path": "n.txt"})
                assert sib2.source == "cache"
                for i in range(3):
                    rec = await s1.call_ex("o_plain", {"x": 1})
                    assert rec.source == "uncacheable" and rec.result.text == f"plain 1 #{i + 1}"
                assert counted["plain"] == 3
                with pytest.raises(ToolError, match="FileNotFound"):
                    await s1.call("read_file", {"workspace": "k", "path": "missing"})
            assert cache.metrics().hits == 2


@pytest.mark.unit
async def test_annotations_from_effects() -> None:
    from bunshin_async.tools import bash_tool, read_file_tool

    assert annotations_for(read_file_tool()).model_dump(by_alias=True, exclude_none=True) == {
        "title": "read_file",
        "readOnlyHint": True,
        "idempotentHint": True,
        "openWorldHint": False,
    }
    assert annotations_for(bash_tool().with_effect(Effect.EXTERNAL)).open_world_hint is True


async def test_stdio_subprocess_round_trip_and_cleanup(tmp_path: Path, clean: Clean) -> None:
    params = StdioServerParameters(command=BUNSHIN, args=["mcp", "serve"], env=bunshin_env())
    async with MCPToolset(params) as toolset:
        client = toolset.client
        _check_listing((await client.list_tools()).tools)
        by_name = {t.name: t for t in toolset.tools}
        assert by_name["read_file"].effect is Effect.READ and by_name["list_dir"].effect is Effect.READ
        assert by_name["bash"].effect is Effect.WRITE and not by_name["bash"].deterministic
        r = await client.call_tool("bash", {"workspace": "s", "command": "echo hi > f; cat f; hostname"})
        assert "hi\nbunshin" in _text(r)
        async with ToolCache() as cache, Workspace() as ws, cache.session(ws, toolset.tools) as session:
            a = await session.call_ex("read_file", {"workspace": "s", "path": "f"})
            b = await session.call_ex("read_file", {"workspace": "s", "path": "f"})
            assert (a.source, b.source, b.result.text) == ("executed", "cache", "hi\n")
        # A call past the client's timeout: the server goes on, and stopping it frees its workspaces.
        with pytest.raises(mcp.MCPError, match="timed out"):
            await client.call_tool("bash", {"workspace": "s", "command": "sleep 30"}, read_timeout_seconds=0.5)
    await clean(grace=10)


async def test_streamable_http_server_and_sigterm_cleanup(clean: Clean) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [BUNSHIN, "mcp", "serve", "--transport", "http", "--port", str(port)],
        env={**os.environ, **bunshin_env()},
        stdout=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        with anyio.fail_after(30):
            while True:
                try:
                    async with mcp.Client(url) as client:
                        break
                except Exception:
                    await anyio.sleep(0.2)
        async with mcp.Client(url) as client:
            _check_listing((await client.list_tools()).tools)
            r = await client.call_tool("bash", {"workspace": "h", "command": "echo over-http"})
            assert "over-http" in _text(r)
        async with mcp.Client(url) as client:  # a new connection, the same keyed workspace
            r = await client.call_tool("bash", {"workspace": "h", "command": "ls /proc | grep -c '^[0-9]'"})
            assert not r.is_error
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(30)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    await clean(grace=10)


async def test_gui_tools_when_the_workspaces_have_a_display() -> None:
    async with WorkspaceServer(display=True) as srv, mcp.Client(srv.server) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert {"screenshot", "click", "type_text", "key", "windows"} <= set(tools)
        assert _hints(tools["screenshot"])["readOnlyHint"] is True
        assert _hints(tools["click"])["destructiveHint"] is True
        r = await client.call_tool("screenshot", {"workspace": "g"})
        assert not r.is_error, _text(r)
        (image,) = r.content
        assert isinstance(image, types.ImageContent) and image.mime_type == "image/png"
        assert base64.b64decode(image.data)[:8] == b"\x89PNG\r\n\x1a\n"
        assert r.structured_content["width"] == 1024 and len(r.structured_content["digest"]) == 64
        r = await client.call_tool("click", {"workspace": "g", "x": 10, "y": 10})
        assert not r.is_error and _text(r) == "ok"
    async with WorkspaceServer() as srv, mcp.Client(srv.server) as client:
        assert "screenshot" not in {t.name for t in (await client.list_tools()).tools}
