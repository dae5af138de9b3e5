"""The one exception tree of Bunshin.

Every error the SDK raises on purpose is a ``BunshinError``; foreign errors (``OSError`` from a mount, a CRIU RPC
failure, an httpx error) are translated once, where the foreign system is called, with ``raise ... from exc``::

    BunshinError
    ├── CapabilityMissing        the host lacks a kernel feature, a binary or a privilege (``remedy`` says what to do)
    ├── ImageError               a workspace image is missing or unusable
    ├── InvalidValue             an argument or setting given to the SDK is out of range (``argument``); a ValueError
    ├── SecurityError            a ``Security`` setting is invalid (``field``)
    ├── UsageError               the SDK was used out of order (``what``); a RuntimeError
    ├── WorkspaceError           something went wrong with one workspace (``workspace_id``)
    │   ├── WorkspaceClosed      the workspace was used after ``aclose()`` or its init died
    │   ├── WorkspaceStartError  the workspace could not be created; nothing of it is left behind
    │   ├── AgentError           the in-workspace agent failed or broke the protocol
    │   ├── ForkError            a fork, snapshot or restore failed; the parent keeps running
    │   │   └── StoreFull        the snapshot store ran out of space (``store``, ``free_bytes``)
    │   └── DisplayError         a workspace's virtual X display failed to start or is not running
    ├── ToolError                a tool call failed (``tool``)
    │   ├── ToolTimeout          the call ran past its timeout; ``stdout``/``stderr`` keep the partial output
    │   ├── PathOutsideWorkspace a path escapes the workspace directory (``..`` or a symlink)
    │   ├── FileNotFound         a path does not exist in the workspace
    │   └── InvalidArgument      an argument is malformed
    │       └── PathTooLong      a path is longer than the kernel takes (``length``, ``limit``): no file is named
    ├── TransferError            a snapshot could not be exported or imported (``snapshot_id``); nothing half-imported
    ├── HostError                a workspace host of a cluster failed or died (``host``); its rollouts fail, not others
    ├── HostCallError            one call failed inside a host that is alive (``host``, ``error``); its workspaces stay
    ├── ServeError               `bunshin e2b serve` could not start on its ``address``; nothing of it is left
    ├── UnknownHost              a cluster has no host of that name (``host``, ``known``); a KeyError
    ├── LLMError                 talking to a model endpoint failed
    │   ├── LLMConnectionError   the endpoint could not be reached (after retries)
    │   ├── LLMHTTPError         the endpoint answered an error status (``status``)
    │   ├── LLMStreamError       a stream was cut or malformed mid-message
    │   └── ToolCallError        the model's tool call is unusable: bad JSON, unknown tool (``tool_name``)
    └── CacheError               the tool prefix cache failed
        └── StoreUnavailable     a cache store (Redis, disk) cannot be used (``store``)

Errors carry structured fields, not just a message, and pickle cleanly because rollouts cross process
boundaries (psutil's ``__reduce__`` pattern: the constructor's keyword arguments are kept in ``_kwargs``).

Exception groups are kept, as anyio and trio keep them, except that where a task group ends inside one operation
(an agent turn, a speculative turn) ``unwrap_group`` raises a group of *one* failure as that failure, so ``except
ToolCallError`` works; several failures stay a group (use ``except*``). Tasks that must not fail their siblings (a
group's rollouts, a CRIU conversation) catch their own errors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ._compat import BaseExceptionGroup

__all__ = [
    "AgentError",
    "BunshinError",
    "CacheError",
    "CapabilityMissing",
    "DisplayError",
    "FileNotFound",
    "ForkError",
    "HostCallError",
    "HostError",
    "ImageError",
    "InvalidArgument",
    "InvalidValue",
    "LLMConnectionError",
    "LLMError",
    "LLMHTTPError",
    "LLMStreamError",
    "PathOutsideWorkspace",
    "PathTooLong",
    "SecurityError",
    "ServeError",
    "StoreFull",
    "StoreUnavailable",
    "ToolCallError",
    "ToolError",
    "ToolTimeout",
    "TransferError",
    "UnknownHost",
    "UsageError",
    "WorkspaceClosed",
    "WorkspaceError",
    "WorkspaceStartError",
]


class BunshinError(Exception):
    """Root of every error Bunshin raises on purpose."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self._kwargs = fields
        for key, value in fields.items():
            setattr(self, key, value)

    @property
    def fields(self) -> dict[str, Any]:
        """The structured fields (the keyword arguments it was made with), e.g. to raise it again reworded."""
        return dict(self._kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self._kwargs))

    def __str__(self) -> str:
        return self.message


@asynccontextmanager
async def unwrap_group() -> AsyncIterator[None]:
    """Around the end of a task group: a group of one exception is raised as that exception (see above)."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def describe(exc: BaseException) -> str:
    """``Type: message``, and for an exception group the same of every failure in it (nested groups flattened):
    a group's own message ("unhandled errors in a TaskGroup (1 sub-exception)") names none of them, and a record
    that keeps only that (a rollout's ``reason``) cannot be diagnosed."""
    if isinstance(exc, BaseExceptionGroup):
        return f"{type(exc).__name__}: " + "; ".join(describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def _rebuild(cls: type[BunshinError], message: str, fields: dict[str, Any]) -> BunshinError:
    # Bypass subclass constructors: some compose their message from fields, which must not happen twice.
    exc = cls.__new__(cls)
    BunshinError.__init__(exc, message, **fields)
    return exc


class CapabilityMissing(BunshinError):
    """The host lacks something Bunshin needs; ``capability`` names it and ``remedy`` says how to get it."""

    capability: str
    remedy: str

    def __init__(self, message: str, *, capability: str, remedy: str) -> None:
        super().__init__(f"{message} ({remedy})", capability=capability, remedy=remedy)


class ImageError(BunshinError):
    """A workspace image is missing or unusable (``image`` is its path or name)."""

    image: str

    def __init__(self, message: str, *, image: str) -> None:
        super().__init__(message, image=image)


class InvalidValue(BunshinError, ValueError):
    """An argument or setting given to the SDK is out of range or malformed (``argument`` names it): a limit below
    its minimum, ``n < 1`` copies, a malformed mode. Also a ``ValueError``, which these were before."""

    argument: str

    def __init__(self, message: str, *, argument: str) -> None:
        super().__init__(message, argument=argument)


class UsageError(BunshinError, RuntimeError):
    """The SDK was used out of order (``what`` names the object): an object used outside its ``async with``, a
    one-shot call made twice. A bug in the caller, not in the host. Also a ``RuntimeError``, which these were
    before."""

    what: str

    def __init__(self, message: str, *, what: str) -> None:
        super().__init__(message, what=what)


class SecurityError(BunshinError):
    """A ``Security`` setting is invalid (``field`` names it): an unknown capability, a malformed device rule."""

    field: str

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message, field=field)


class WorkspaceError(BunshinError):
    """A failure tied to one workspace (``workspace_id``)."""

    workspace_id: str

    def __init__(self, message: str, *, workspace_id: str, **fields: Any) -> None:
        super().__init__(message, workspace_id=workspace_id, **fields)


class WorkspaceClosed(WorkspaceError):
    """The workspace was closed (or its init died); open a new one or fork a live one."""


class WorkspaceStartError(WorkspaceError):
    """The workspace could not be created; everything made for it was removed again."""


class AgentError(WorkspaceError):
    """The agent inside the workspace failed or broke the protocol. ``reason`` says how: the agent's own
    ``"protocol"`` or ``"internal"`` failure, or what the host refused of what answered on its socket to
    ``request`` (``"protocol"``: not an answer it expects, ``"oversized"``: larger than it can be, ``"stalled"``:
    stopped mid-frame, ``"truncated"``: cut off mid-frame, ``"socket"``: the socket was removed or replaced, which
    the host does not follow). The connection that carried it is closed; the workspace's others are not."""

    reason: str
    request: str

    def __init__(self, message: str, *, workspace_id: str, reason: str = "protocol", request: str = "") -> None:
        super().__init__(message, workspace_id=workspace_id, reason=reason, request=request)


class ForkError(WorkspaceError):
    """A fork, snapshot or restore failed. The parent workspace keeps running and no half-made copy is left."""


class StoreFull(ForkError):
    """The snapshot store (``store``, a tmpfs) had no space left for a snapshot's images or files (``free_bytes``
    left when it failed). Nothing half-made is kept; close snapshots (or copies mapping them) or run ``bunshin gc``,
    then retry."""

    store: str
    free_bytes: int

    def __init__(self, message: str, *, workspace_id: str, store: str, free_bytes: int, **fields: Any) -> None:
        super().__init__(message, workspace_id=workspace_id, store=store, free_bytes=free_bytes, **fields)


class DisplayError(WorkspaceError):
    """The workspace's virtual X display did not start (``detail`` holds the X server's log tail) or is not
    running (no ``display=`` given, or the X server died). Start the workspace with ``display=True``."""

    detail: str

    def __init__(self, message: str, *, workspace_id: str, detail: str = "") -> None:
        super().__init__(message, workspace_id=workspace_id, detail=detail)


class ToolError(BunshinError):
    """A tool call failed (``tool`` names it)."""

    tool: str

    def __init__(self, message: str, *, tool: str, **fields: Any) -> None:
        super().__init__(message, tool=tool, **fields)


class ToolTimeout(ToolError):
    """The call ran past ``timeout`` seconds and was killed; ``stdout`` and ``stderr`` hold what it printed."""

    timeout: float
    stdout: str
    stderr: str

    def __init__(self, message: str, *, tool: str, timeout: float, stdout: str = "", stderr: str = "") -> None:
        super().__init__(message, tool=tool, timeout=timeout, stdout=stdout, stderr=stderr)


class PathOutsideWorkspace(ToolError):
    """A path resolves outside the workspace directory (through ``..`` or a symlink)."""

    path: str

    def __init__(self, message: str, *, tool: str, path: str) -> None:
        super().__init__(message, tool=tool, path=path)


class FileNotFound(ToolError):
    """A path does not exist inside the workspace."""

    path: str

    def __init__(self, message: str, *, tool: str, path: str) -> None:
        super().__init__(message, tool=tool, path=path)


class InvalidArgument(ToolError):
    """An argument of a tool call is malformed."""


class PathTooLong(InvalidArgument):
    """A path (``path``, ``length`` bytes as given) is longer than the kernel takes once it is joined to the
    workspace directory and its symlinks are followed (``limit``: PATH_MAX, 4096 bytes with the final NUL). The
    agent refuses it rather than cut it short, which would name another file. Use a shorter path, or ``exec`` with
    a relative path from a working directory deeper in the tree."""

    path: str
    length: int
    limit: int

    def __init__(self, message: str, *, tool: str, path: str, length: int, limit: int = 4096) -> None:
        super().__init__(message, tool=tool, path=path, length=length, limit=limit)


class TransferError(BunshinError):
    """A snapshot stream could not be exported or imported: corrupted, truncated, malformed, or for an image or
    Bunshin version this host lacks. An import that raises it has left nothing in the snapshot store."""

    snapshot_id: str

    def __init__(self, message: str, *, snapshot_id: str) -> None:
        super().__init__(message, snapshot_id=snapshot_id)


class HostError(BunshinError):
    """A workspace host (a ``WorkspaceHost`` actor of a Ray cluster, ``host`` names its node) failed or died; the
    workspaces and snapshots it held are gone with it."""

    host: str

    def __init__(self, message: str, *, host: str) -> None:
        super().__init__(message, host=host)


class HostCallError(BunshinError):
    """One call failed inside a workspace host that is still alive (``host`` names it; ``error`` is the type of what
    it raised there, not a ``BunshinError``): that call failed, the host and its workspaces stay usable. Not a
    ``HostError``, which says they are gone."""

    host: str
    error: str

    def __init__(self, message: str, *, host: str, error: str) -> None:
        super().__init__(message, host=host, error=error)


class ServeError(BunshinError):
    """A server Bunshin runs (the E2B endpoint) could not start on ``address``: the port is taken, the address cannot
    be bound, or the HTTP server failed to start. Whatever the start had made (its socket, tasks, the backend's
    hosts) is released before it is raised."""

    address: str

    def __init__(self, message: str, *, address: str) -> None:
        super().__init__(message, address=address)


class UnknownHost(BunshinError, KeyError):
    """A cluster has no host named ``host`` (``known``: the names it has). Also a ``KeyError``, which it was
    before."""

    host: str
    known: tuple[str, ...]

    def __init__(self, message: str, *, host: str, known: tuple[str, ...]) -> None:
        super().__init__(message, host=host, known=known)


class LLMError(BunshinError):
    """Talking to a model endpoint failed."""


class LLMConnectionError(LLMError):
    """The endpoint could not be reached, after the configured retries."""


class LLMHTTPError(LLMError):
    """The endpoint answered with an error ``status`` (after retries for 429 and 5xx); ``body`` is its text."""

    status: int
    body: str

    def __init__(self, message: str, *, status: int, body: str = "") -> None:
        super().__init__(message, status=status, body=body)


class LLMStreamError(LLMError):
    """A stream was cut or malformed before the message finished."""


class ToolCallError(LLMError):
    """A tool call from the model cannot be used: arguments that are not valid JSON or do not fit the schema, or
    a tool that does not exist (``tool_name``; ``index`` is the call's position in the message)."""

    tool_name: str
    index: int

    def __init__(self, message: str, *, tool_name: str, index: int = 0) -> None:
        super().__init__(message, tool_name=tool_name, index=index)


class CacheError(BunshinError):
    """The tool prefix cache failed."""


class StoreUnavailable(CacheError):
    """A cache store cannot be used (``store`` names it); the cache degrades to its local stores."""

    store: str

    def __init__(self, message: str, *, store: str) -> None:
        super().__init__(message, store=store)
