"""Bunshin: live-forkable agent workspaces for agentic RL rollouts, driven from asyncio."""

from __future__ import annotations

from ._exceptions import (
    AgentError as AgentError,
    BunshinError as BunshinError,
    CapabilityMissing as CapabilityMissing,
    FileNotFound as FileNotFound,
    ForkError as ForkError,
    ImageError as ImageError,
    InvalidArgument as InvalidArgument,
    PathOutsideWorkspace as PathOutsideWorkspace,
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
    "CapabilityMissing",
    "DirEntry",
    "ExecResult",
    "FileNotFound",
    "ForkError",
    "Image",
    "ImageError",
    "InvalidArgument",
    "Limits",
    "PathOutsideWorkspace",
    "Shell",
    "ToolError",
    "ToolTimeout",
    "Workspace",
    "WorkspaceClosed",
    "WorkspaceError",
    "WorkspaceStartError",
]
