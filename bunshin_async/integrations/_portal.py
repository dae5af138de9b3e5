"""An event loop in a background thread for harnesses whose environment interface is synchronous (mini-swe-agent,
SkyRL-gym).

``PortalRuntime`` runs one anyio blocking portal in a daemon thread; every workspace of the environments that use
it lives on that loop, and each synchronous call blocks on it. It tracks the workspaces it started, so
``close_all()`` (run at interpreter exit for the default runtime) frees those a harness abandoned.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import TypeVar

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from .._workspace._facade import Workspace

__all__ = ["PortalRuntime"]

T = TypeVar("T")


class PortalRuntime:
    """A loop in a daemon thread that owns workspaces for synchronous callers. Thread-safe; ``close_all()`` closes
    every workspace still open and stops the loop (a later call starts a new one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._live: dict[str, Workspace] = {}

    @property
    def portal(self) -> BlockingPortal:
        with self._lock:
            if self._portal is None:
                self._cm = start_blocking_portal()
                self._portal = self._cm.__enter__()
            return self._portal

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the loop and wait for it (its exception is raised here)."""
        return self.portal.call(fn)

    @property
    def live(self) -> int:
        """How many workspaces this runtime started are open now."""
        with self._lock:
            return sum(not ws.closed for ws in self._live.values())

    def start(self, ws: Workspace) -> Workspace:
        """Start ``ws`` on the loop (a failed start leaves nothing behind) and track it."""
        self.call(ws.start)
        with self._lock:
            self._live[ws.id] = ws
        return ws

    def close(self, ws: Workspace) -> None:
        """Close ``ws`` (idempotent). Shielded: an interrupt of the caller does not leave it half closed."""
        with self._lock:
            self._live.pop(ws.id, None)
            portal = self._portal
        if portal is not None and not ws.closed:
            portal.call(_shielded_close, ws)

    def close_all(self) -> None:
        """Close every workspace still open and stop the loop. Idempotent."""
        with self._lock:
            portal, cm = self._portal, self._cm
            self._portal = self._cm = None
            live, self._live = list(self._live.values()), {}
        if portal is None or cm is None:
            return
        try:
            for ws in live:
                portal.call(_shielded_close, ws)
            portal.call(self._aclose_owned)
        finally:
            cm.__exit__(None, None, None)

    async def _aclose_owned(self) -> None:
        """What a subclass owns beyond the workspaces it started (closed on the loop, before it stops)."""


async def _shielded_close(ws: Workspace) -> None:
    with anyio.CancelScope(shield=True):
        await ws.aclose()
