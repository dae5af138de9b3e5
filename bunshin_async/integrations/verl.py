"""verl 0.9 (its own environment: it pulls torch): a tool agent loop registered as ``bunshin_tool_agent`` and
``BaseTool``s (``BashTool``, ``ReadFileTool``, ``WriteFileTool``) that run in Bunshin workspaces through the tool
cache, the samples of one ``uid`` forked from one set-up. See ``bunshin_async.integrations._verl``."""

from __future__ import annotations

from ._verl import AGENT_NAME as AGENT_NAME
from ._verl import BashTool as BashTool
from ._verl import BunshinToolAgentLoop as BunshinToolAgentLoop
from ._verl import ReadFileTool as ReadFileTool
from ._verl import VerlRuntime as VerlRuntime
from ._verl import WriteFileTool as WriteFileTool
from ._verl import default_runtime as default_runtime

__all__ = [
    "AGENT_NAME",
    "BashTool",
    "BunshinToolAgentLoop",
    "ReadFileTool",
    "VerlRuntime",
    "WriteFileTool",
    "default_runtime",
]
