"""Bunshin: live-forkable agent workspaces for agentic RL rollouts, driven from asyncio."""

from __future__ import annotations

from ._config import Config as Config
from ._core import SetupStep as SetupStep
from ._exceptions import (
    AgentError as AgentError,
)
from ._exceptions import (
    BunshinError as BunshinError,
)
from ._exceptions import (
    CacheError as CacheError,
)
from ._exceptions import (
    CapabilityMissing as CapabilityMissing,
)
from ._exceptions import (
    DisplayError as DisplayError,
)
from ._exceptions import (
    FileNotFound as FileNotFound,
)
from ._exceptions import (
    ForkError as ForkError,
)
from ._exceptions import (
    HostError as HostError,
)
from ._exceptions import (
    ImageError as ImageError,
)
from ._exceptions import (
    InvalidArgument as InvalidArgument,
)
from ._exceptions import (
    LLMConnectionError as LLMConnectionError,
)
from ._exceptions import (
    LLMError as LLMError,
)
from ._exceptions import (
    LLMHTTPError as LLMHTTPError,
)
from ._exceptions import (
    LLMStreamError as LLMStreamError,
)
from ._exceptions import (
    PathOutsideWorkspace as PathOutsideWorkspace,
)
from ._exceptions import (
    SecurityError as SecurityError,
)
from ._exceptions import (
    StoreFull as StoreFull,
)
from ._exceptions import (
    StoreUnavailable as StoreUnavailable,
)
from ._exceptions import (
    ToolCallError as ToolCallError,
)
from ._exceptions import (
    ToolError as ToolError,
)
from ._exceptions import (
    ToolTimeout as ToolTimeout,
)
from ._exceptions import (
    TransferError as TransferError,
)
from ._exceptions import (
    WorkspaceClosed as WorkspaceClosed,
)
from ._exceptions import (
    WorkspaceError as WorkspaceError,
)
from ._exceptions import (
    WorkspaceStartError as WorkspaceStartError,
)
from ._fork._snapshot import Snapshot as Snapshot
from ._gui import Display as Display
from ._gui import Screenshot as Screenshot
from ._gui import Window as Window
from ._image import Image as Image
from ._kernel import Limits as Limits
from ._layers import ImportLimits as ImportLimits
from ._oci import ImageConfig as ImageConfig
from ._protocol import DirEntry as DirEntry
from ._protocol import ExecResult as ExecResult
from ._security import Security as Security
from ._workspace import BackgroundProcess as BackgroundProcess
from ._workspace import Shell as Shell
from ._workspace import Workspace as Workspace

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
    "HostError",
    "Image",
    "ImageConfig",
    "ImageError",
    "ImportLimits",
    "InvalidArgument",
    "LLMConnectionError",
    "LLMError",
    "LLMHTTPError",
    "LLMStreamError",
    "Limits",
    "PathOutsideWorkspace",
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
