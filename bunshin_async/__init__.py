"""Bunshin: live-forkable agent workspaces for agentic RL rollouts, driven from asyncio."""

from __future__ import annotations

from ._config import Config
from ._exceptions import (
    AgentError,
    BunshinError,
    CacheError,
    CapabilityMissing,
    DisplayError,
    FileNotFound,
    ForkError,
    HostCallError,
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
    ServeError,
    StoreFull,
    StoreUnavailable,
    ToolCallError,
    ToolError,
    ToolTimeout,
    TransferError,
    UnknownHost,
    UsageError,
    WorkspaceClosed,
    WorkspaceError,
    WorkspaceStartError,
)
from ._fork._snapshot import Snapshot
from ._host._kernel import Limits
from ._host._protocol import DirEntry, ExecResult
from ._host._security import Security
from ._images._image import Image
from ._images._oci import ImageConfig
from ._images._untar import ImportLimits
from ._public import publish as _publish
from ._workspace._core import SetupStep
from ._workspace._facade import BackgroundProcess, Shell, Workspace
from ._workspace._gui import Display, Gui, Screenshot, Window

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
    "HostCallError",
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
    "ServeError",
    "SetupStep",
    "Shell",
    "Snapshot",
    "StoreFull",
    "StoreUnavailable",
    "ToolCallError",
    "ToolError",
    "ToolTimeout",
    "TransferError",
    "UnknownHost",
    "UsageError",
    "Window",
    "Workspace",
    "WorkspaceClosed",
    "WorkspaceError",
    "WorkspaceStartError",
]

_publish(__name__, globals())
