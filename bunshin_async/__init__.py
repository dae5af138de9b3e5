"""Bunshin: live-forkable agent workspaces for agentic RL rollouts, driven from asyncio."""

from __future__ import annotations

from ._exceptions import (
    AgentError as AgentError,
    BunshinError as BunshinError,
    CacheError as CacheError,
    CapabilityMissing as CapabilityMissing,
    FileNotFound as FileNotFound,
    ForkError as ForkError,
    ImageError as ImageError,
    InvalidArgument as InvalidArgument,
    LLMConnectionError as LLMConnectionError,
    LLMError as LLMError,
    LLMHTTPError as LLMHTTPError,
    LLMStreamError as LLMStreamError,
    PathOutsideWorkspace as PathOutsideWorkspace,
    StoreUnavailable as StoreUnavailable,
    ToolCallError as ToolCallError,
    ToolError as ToolError,
    ToolTimeout as ToolTimeout,
    WorkspaceClosed as WorkspaceClosed,
    WorkspaceError as WorkspaceError,
    WorkspaceStartError as WorkspaceStartError,
)
from ._image import Image as Image
from ._kernel import Limits as Limits
from ._protocol import DirEntry as DirEntry, ExecResult as ExecResult
from ._workspace import BackgroundProcess as BackgroundProcess, Shell as Shell, Workspace as Workspace

__version__ = "0.1.0"

__all__ = [
    "AgentError",
    "BackgroundProcess",
    "BunshinError",
    "CacheError",
    "CapabilityMissing",
    "DirEntry",
    "ExecResult",
    "FileNotFound",
    "ForkError",
    "Image",
    "ImageError",
    "InvalidArgument",
    "LLMConnectionError",
    "LLMError",
    "LLMHTTPError",
    "LLMStreamError",
    "Limits",
    "PathOutsideWorkspace",
    "StoreUnavailable",
    "ToolCallError",
    "Shell",
    "ToolError",
    "ToolTimeout",
    "Workspace",
    "WorkspaceClosed",
    "WorkspaceError",
    "WorkspaceStartError",
]
