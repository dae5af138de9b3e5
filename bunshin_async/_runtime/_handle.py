"""``WorkspaceHandle``: the agent loop's reference to "its" workspace, which speculation may replace.

A committed speculative write means the rollout now lives in the branch's fork. The handle is the one place the
agent loop reads the workspace from, so the swap is a single assignment made under the handle's lock: whoever
holds the handle sees either the old workspace (before the call) or the new one (after it), never a mix. Code that
needs a stable workspace across several awaits takes ``async with handle.pinned() as ws``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType

import anyio

from .._workspace import Workspace
from ._calls import CallKey, chain_root, extend_chain
from ._metrics import RolloutMetrics

__all__ = ["WorkspaceHandle"]

CLOSE_DEADLINE = 10.0


class WorkspaceHandle:
    """Points at the rollout's current workspace and tracks its call history.

    ``own=True`` (the default) makes the handle responsible for closing the workspace it points at when it is
    replaced or when the handle is closed; with ``own=False`` the first workspace stays the caller's, while forks
    committed later are always owned. ``epoch`` counts the committed state changes (it names the workspace state
    for matching branches); ``chain`` is the prefix hash of every call made so far (reads too), the key sibling
    rollouts share. ``salt`` separates tasks (use the task id: rollouts of one group must use the same salt).
    ``metrics`` sums the speculation metrics of its turns.
    """

    def __init__(self, workspace: Workspace, *, own: bool = True, salt: str = "") -> None:
        self._ws = workspace
        self._owned = own
        self._lock = anyio.Lock()
        self.epoch = 0
        self.chain = chain_root(salt)
        self.history: list[CallKey] = []
        self.salt = salt
        self.swaps = 0
        self.turns = 0
        self.metrics = RolloutMetrics()

    @property
    def workspace(self) -> Workspace:
        """The current workspace. Between turns it is stable; during a turn use ``pinned()`` for several awaits."""
        return self._ws

    @asynccontextmanager
    async def pinned(self) -> AsyncIterator[Workspace]:
        """Hold the current workspace: no swap happens inside the block."""
        async with self._lock:
            yield self._ws

    @property
    def lock(self) -> anyio.Lock:
        """Held while the state changes (a write runs, a fork is taken, a branch is committed)."""
        return self._lock

    def record(self, call: CallKey) -> None:
        """Append ``call`` (as the model made it) to the history."""
        self.history.append(call)
        self.chain = extend_chain(self.chain, call)

    def advance(self) -> None:
        """The workspace state changed (a write ran or a branch was committed). Caller holds ``lock``."""
        self.epoch += 1

    async def _swap(self, new: Workspace) -> None:
        """Point at ``new`` (owned from now on) and close the previous workspace if owned. Caller holds ``lock``."""
        old, owned = self._ws, self._owned
        self._ws, self._owned = new, True
        self.swaps += 1
        if owned and old is not new:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_DEADLINE):
                await old.aclose()

    async def aclose(self) -> None:
        """Close the current workspace if the handle owns it. Idempotent."""
        if self._owned:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_DEADLINE):
                await self._ws.aclose()

    async def __aenter__(self) -> WorkspaceHandle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<WorkspaceHandle {self._ws.id} epoch={self.epoch} calls={len(self.history)}>"
