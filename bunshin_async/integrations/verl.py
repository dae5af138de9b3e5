"""verl 0.9 (its own environment: it pulls torch): a tool agent loop registered as ``bunshin_tool_agent`` and
``BaseTool``s (``BashTool``, ``ReadFileTool``, ``WriteFileTool``) that run in Bunshin workspaces through the tool
cache, the samples of one ``uid`` forked from one set-up. See ``bunshin_async.integrations._verl``."""

from __future__ import annotations

from .._public import publish as _publish
from ._verl import AGENT_NAME, BashTool, BunshinToolAgentLoop, ReadFileTool, VerlRuntime, WriteFileTool, default_runtime

__all__ = [
    "AGENT_NAME",
    "BashTool",
    "BunshinToolAgentLoop",
    "ReadFileTool",
    "VerlRuntime",
    "WriteFileTool",
    "default_runtime",
]

_publish(__name__, globals())
