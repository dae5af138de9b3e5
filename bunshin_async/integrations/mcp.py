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

from ._mcp import MCPImage as MCPImage
from ._mcp import MCPToolResult as MCPToolResult
from ._mcp import MCPToolset as MCPToolset
from ._mcp import WorkspaceServer as WorkspaceServer
from ._mcp import annotations_for as annotations_for
from ._mcp import serve as serve

__all__ = ["MCPImage", "MCPToolResult", "MCPToolset", "WorkspaceServer", "annotations_for", "serve"]

# The public path in reprs and docs; msgspec Structs keep theirs, since msgspec resolves their (string)
# annotations in the module named by ``__module__``.
for _name in ("MCPToolset", "WorkspaceServer", "annotations_for", "serve"):
    globals()[_name].__module__ = __name__
del _name
