"""MCP (``pip install 'bunshin[mcp]'``): serve workspaces' tools to MCP clients, use MCP servers' tools as Bunshin
tools. See ``bunshin_async.integrations._mcp`` for the policies::

    async with WorkspaceServer() as srv, mcp.Client(srv.server) as client:
        await client.call_tool("bash", {"workspace": "rollout-1", "command": "ls"})

    async with MCPToolset("http://127.0.0.1:8000/mcp") as toolset, ToolCache() as cache:
        async with cache.session(ws, toolset.tools) as session:
            await session.call("read_file", {"workspace": "rollout-1", "path": "README.md"})

``bunshin mcp serve [--transport stdio|http]`` runs a ``WorkspaceServer``.
"""

from __future__ import annotations

from .._public import publish as _publish
from ._mcp import MCPImage, MCPToolResult, MCPToolset, WorkspaceServer, annotations_for, serve

__all__ = ["MCPImage", "MCPToolResult", "MCPToolset", "WorkspaceServer", "annotations_for", "serve"]

_publish(__name__, globals())
