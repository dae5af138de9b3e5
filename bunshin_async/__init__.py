"""Bunshin: live-forkable agent workspaces for agentic RL rollouts, driven from asyncio."""

from __future__ import annotations

from ._config import Config
from ._core import SetupStep
from ._exceptions import (
    AgentError,
    BunshinError,
    CacheError,
    CapabilityMissing,
    DisplayError,
    FileNotFound,
    ForkError,
    HostError,
    ImageError,
    InvalidArgument,
    InvalidValue,
    LLMConnectionError,
    LLMError,
    LLMHTTPError,
    LLMStreamError,
    PathOutsideWorkspace,
    PathTooLong,
    SecurityError,
    StoreFull,
    StoreUnavailable,
    ToolCallError,
    ToolError,
    ToolTimeout,
    TransferError,
    WorkspaceClosed,
    WorkspaceError,
    WorkspaceStartError,
)
from ._fork._snapshot import Snapshot
from ._gui import Display, Gui, Screenshot, Window
from ._image import Image
from ._kernel import Limits
from ._layers import ImportLimits
from ._oci import ImageConfig
from ._protocol import DirEntry, ExecResult
from ._public import publish as _publish
from ._security import Security
from ._workspace import BackgroundProcess, Shell, Workspace

__version__ = "0.1.0"

__all__ = [
    "AgentError",
    "BackgroundProcess",
    "BunshinError",
    "CacheError",
    "CapabilityMissing",
    "Config",
    "DirEntry",
    "Display",
    "DisplayError",
    "ExecResult",
    "FileNotFound",
    "ForkError",
    "Gui",
    "HostError",
    "Image",
    "ImageConfig",
    "ImageError",
    "ImportLimits",
    "InvalidArgument",
    "InvalidValue",
    "LLMConnectionError",
    "LLMError",
    "LLMHTTPError",
    "LLMStreamError",
    "Limits",
    "PathOutsideWorkspace",
    "PathTooLong",
    "Screenshot",
    "Security",
    "SecurityError",
    "SetupStep",
    "Shell",
    "Snapshot",
    "StoreFull",
    "StoreUnavailable",
    "ToolCallError",
    "ToolError",
    "ToolTimeout",
    "TransferError",
    "Window",
    "Workspace",
    "WorkspaceClosed",
    "WorkspaceError",
    "WorkspaceStartError",
]

_publish(__name__, globals())
