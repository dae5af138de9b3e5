"""Bunshin over MCP, both ways: an MCP client drives keyed workspaces (fork included), and the server's tools come
back as Bunshin tools whose cache policy follows their annotations.

    python examples/mcp_workspaces.py           # the server in process
    python examples/mcp_workspaces.py --stdio   # the server as a subprocess: `bunshin mcp serve`

Needs root (workspaces) and ``pip install 'bunshin[mcp]'``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import mcp
from mcp import StdioServerParameters

from bunshin_async import Workspace
from bunshin_async.cache import ToolCache
from bunshin_async.integrations.mcp import MCPToolset, WorkspaceServer


def text(result: mcp.types.CallToolResult) -> str:
    return "".join(b.text for b in result.content if isinstance(b, mcp.types.TextContent)).strip()


async def drive(client: mcp.Client) -> None:
    for tool in (await client.list_tools()).tools:
        hints = tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else {}
        print(f"{tool.name:16} {hints}")
    await client.call_tool("write_file", {"workspace": "r0", "path": "notes.txt", "content": "set-up done\n"})
    await client.call_tool("bash", {"workspace": "r0", "command": "python3 -m http.server 8000 >/dev/null 2>&1 &"})
    await client.call_tool("workspace_fork", {"workspace": "r0", "into": ["r1", "r2"]})
    await client.call_tool("bash", {"workspace": "r1", "command": "echo only in r1 >> notes.txt"})
    probe = "cat notes.txt; python3 -c 'import urllib.request as u; print(u.urlopen(\"http://localhost:8000\").status)'"
    for key in ("r0", "r1", "r2"):
        r = await client.call_tool("bash", {"workspace": key, "command": probe})
        print(key, "->", text(r).replace("\n", " | "))


async def main() -> None:
    if "--stdio" in sys.argv:
        server = StdioServerParameters(command=str(Path(sys.executable).with_name("bunshin")), args=["mcp", "serve"])
        async with MCPToolset(server) as toolset:
            await drive(toolset.client)
            await cached_reads(toolset)
    else:
        async with WorkspaceServer() as srv, mcp.Client(srv.server) as client:
            await drive(client)
            async with MCPToolset(client) as toolset:
                await cached_reads(toolset)


async def cached_reads(toolset: MCPToolset) -> None:
    async with ToolCache() as cache, Workspace() as ws, cache.session(ws, toolset.tools) as session:
        for _ in range(3):
            record = await session.call_ex("read_file", {"workspace": "r1", "path": "notes.txt"})
            print("read_file via the cache:", record.source)


if __name__ == "__main__":
    anyio.run(main)
