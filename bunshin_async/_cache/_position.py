"""Where a ``CachedSession`` stands: its state chain, the state it is at (pinned in the cache's state tree, so the
snapshots a sibling could still restore from there are kept) and the workspace it is in."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .._runtime._handle import WorkspaceSlot
from ._keys import StateChain
from ._shared import CacheState

if TYPE_CHECKING:
    from .._workspace._facade import Workspace


class Position:
    """A session's place in ``shared``'s state tree: ``chain`` and the state ``key`` it is at (pinned while the
    session stands there), and ``slot``, the current workspace with whether the session closes it."""

    def __init__(self, shared: CacheState, chain: StateChain, slot: WorkspaceSlot) -> None:
        self.shared = shared
        self.chain = chain
        self.slot = slot
        self.key = chain.key
        shared.tree.pin(self.key)
        self.since = shared.tree.clock()  # when it arrived at ``key``

    @property
    def workspace(self) -> Workspace:
        return self.slot.workspace

    async def advance(self, call: bytes) -> None:
        """Move to the state ``call`` (an encoded write) leads to."""
        await self._move(lambda: self.chain.advance(call))

    async def taint(self) -> None:
        """Move to a state no other session can name (after a write nobody can reproduce)."""
        await self._move(self.chain.taint)

    async def _move(self, step: Callable[[], object]) -> None:
        """Apply ``step`` to the chain and move the pin to the new state (the old state's snapshot may then be
        evicted); the time it stood on the old one is the cache's ``pace``."""
        old = self.key
        step()
        self.key = self.chain.key
        tree = self.shared.tree
        now = tree.clock()
        self.shared.pace.observe(now - self.since)  # how long a session takes from one state to the next
        self.since = now
        tree.pin(self.key, old)
        tree.unpin(old)
        await self.shared.discard(tree.evict())

    async def leave(self) -> None:
        """Unpin the state (its snapshot may go) and close the workspace if the session owns it."""
        tree = self.shared.tree
        tree.unpin(self.key)
        await self.shared.discard(tree.evict())
        await self.slot.aclose()
