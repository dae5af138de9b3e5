"""Workspace states: snapshot references, the ``StateProvider`` protocol, its live-fork implementation and the
prefix tree of states.

A hit on a ``write`` call cannot be served by returning a result: the workspace must end up in the state the call
left behind. A ``StateProvider`` captures that state after a call ran and restores it later; ``ForkStateProvider``
does it with a live snapshot (processes and files) and a fork of it. A ``ToolCache`` without a provider executes
every write and serves only ``read``/``pure`` hits.

The tree mirrors the state chains of this process's sessions: a node per state, its parent, the snapshot captured
there (if any) and how many sessions stand on it or restore from it. A pinned node's snapshot is never evicted;
the rest are evicted least recently used beyond the snapshot byte budget.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import anyio

from .._exceptions import ForkError
from .._fork._snapshot import Snapshot, record_of
from .._workspace._facade import Workspace
from ._hold import Waiter
from ._records import SnapshotRef

__all__ = ["ForkStateProvider", "SnapshotRef", "StateProvider", "StateTree"]


class StateProvider(Protocol):
    """Captures and restores workspace states for ``write`` hits.

    ``capture`` must not change ``ws`` and returns a ref whose ``size`` is what keeping it costs (bytes).
    ``restore`` returns the workspace the session continues with, in the captured state: a new workspace (a fork
    of the snapshot; the session then owns it and closes it when done) or ``ws`` itself restored in place. It may
    raise any ``BunshinError`` (``ForkError`` typically); the session then executes the call instead.
    ``discard`` frees a snapshot the cache evicted; it is never called for a ref in use.
    """

    async def capture(self, ws: Workspace) -> SnapshotRef: ...

    async def restore(self, ws: Workspace, ref: SnapshotRef) -> Workspace: ...

    async def discard(self, ref: SnapshotRef) -> None: ...


class ForkStateProvider:
    """Write hits served by live fork: the session continues in a copy of the workspace as the write left it,
    running processes (and what they hold in memory) included.

    ``capture`` takes ``ws.snapshot()`` and keeps it until ``discard`` (the cache calls it on eviction and when it
    closes); a ref's ``size`` is the bytes of the snapshot directory (CRIU images and the upper dir copy, on tmpfs),
    read without walking the workspace's tree (``SnapshotRecord.stored_bytes``: the copy tallied what it made).
    ``restore`` returns a new workspace forked from the snapshot, which the session that asked owns; ``ws`` is left
    alone. Refs name snapshots held by this object only: one evicted meanwhile, or read from a shared store where
    another process put it, fails the restore with ``ForkError`` and the call runs instead.
    """

    def __init__(self) -> None:
        self._snaps: dict[str, Snapshot] = {}

    def __len__(self) -> int:
        """Snapshots held."""
        return len(self._snaps)

    async def capture(self, ws: Workspace) -> SnapshotRef:
        snap = await ws.snapshot()
        try:
            size = await anyio.to_thread.run_sync(record_of(snap).stored_bytes)
        except BaseException:
            await snap.aclose()
            raise
        self._snaps[snap.id] = snap
        return SnapshotRef(snap.id, size)

    async def restore(self, ws: Workspace, ref: SnapshotRef) -> Workspace:
        snap = self._snaps.get(ref.id)
        if snap is None:
            raise ForkError(f"snapshot {ref.id} is not held here (evicted, or captured elsewhere)", workspace_id=ws.id)
        (fork,) = await Workspace.from_snapshot(snap, 1)
        return fork

    async def discard(self, ref: SnapshotRef) -> None:
        snap = self._snaps.pop(ref.id, None)
        if snap is not None:
            await snap.aclose()


class _Node:
    __slots__ = (
        "key", "parent", "children", "snapshot", "refs", "restoring", "last_used", "depth", "visits", "arrivals",
    )  # fmt: skip

    def __init__(self, key: bytes, parent: _Node | None, now: float) -> None:
        self.key = key
        self.parent = parent
        self.children: set[bytes] = set()
        self.snapshot: SnapshotRef | None = None
        self.refs = 0
        self.restoring = 0  # restores from its snapshot under way
        self.last_used = now
        self.depth: int = parent.depth + 1 if parent is not None else 0
        self.visits = 0  # sessions that ever arrived here
        self.arrivals: deque[float] = deque()  # when the sessions standing here arrived, oldest first


class StateTree:
    """States of this process, with reference counts and an LRU snapshot budget (``snapshot_budget`` bytes).

    With ``release_unreachable`` a snapshot is kept only while it can serve a hit (``reachable``): a session's
    state only moves down the tree, so once no session stands on a state above the snapshot's (and no restore from
    it is under way), no open session can ask for it again, and keeping it would cost its bytes for the rest of the
    run for nothing. Right when every session that may use a snapshot is open before it is taken (the rollouts of
    a ``GroupRollout`` group open together); a session opened later would find it gone. ``waiters`` says who could
    still ask for a state, from where, and since when (``clock``: ``time.monotonic`` but in tests)."""

    def __init__(
        self, snapshot_budget: int, release_unreachable: bool = False, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.snapshot_budget = snapshot_budget
        self.release_unreachable = release_unreachable
        self.clock = clock
        self._nodes: dict[bytes, _Node] = {}
        self.snapshot_bytes = 0
        self.snapshots = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._nodes

    def refs(self, key: bytes) -> int:
        node = self._nodes.get(key)
        return node.refs if node else 0

    def snapshot(self, key: bytes) -> SnapshotRef | None:
        node = self._nodes.get(key)
        return node.snapshot if node else None

    def pin(self, key: bytes, parent: bytes | None = None, *, visit: bool = True) -> None:
        """Hold the state ``key`` (a child of ``parent``): its snapshot is not evicted until ``unpin``. ``visit``: a
        session arrives there (False: a restore holds it meanwhile)."""
        now = self.clock()
        node = self._nodes.get(key)
        if node is None:
            pnode = self._nodes.get(parent) if parent is not None else None
            node = self._nodes[key] = _Node(key, pnode, now)
            if pnode is not None:
                pnode.children.add(key)
        node.refs += 1
        node.last_used = now
        if visit:
            node.visits += 1
            node.arrivals.append(now)

    def reachable(self, key: bytes) -> bool:
        """Whether a snapshot of state ``key`` could still serve a hit: a session stands on a state above it (which
        may move to it), or a restore from it is under way."""
        node = self._nodes.get(key)
        if node is None:
            return False
        if node.restoring > 0:
            return True
        up = node.parent
        while up is not None:
            if up.refs > 0:
                return True
            up = up.parent
        return False

    def waiters(self, key: bytes) -> list[Waiter]:
        """The sessions standing on a state above ``key`` (each may still move to it), nearest first: per state, how
        many, how far above, the share of the sessions that left it which went on to ``key`` (at most 1; sessions
        still standing there have not chosen) and how long the last of them has stood there."""
        node = self._nodes.get(key)
        if node is None:
            return []
        now, out = self.clock(), []
        up = node.parent
        while up is not None:
            if up.arrivals:
                left = up.visits - len(up.arrivals)
                follow = min(1.0, node.visits / left) if left > 0 else 1.0
                out.append(Waiter(node.depth - up.depth, len(up.arrivals), follow, now - up.arrivals[-1]))
            up = up.parent
        return out

    def restoring(self, key: bytes, delta: int) -> None:
        """Count a restore from ``key``'s snapshot starting (``+1``) or ending (``-1``); the state must be pinned."""
        self._nodes[key].restoring += delta

    def unpin(self, key: bytes, *, visit: bool = True) -> None:
        """Let go of ``key`` (``visit``: a session leaves it; which one is not known: the longest there, taken to
        leave first)."""
        node = self._nodes.get(key)
        if node is None:
            return
        node.refs -= 1
        node.last_used = self.clock()
        if visit and node.arrivals:
            node.arrivals.popleft()
        self._prune(node)

    def _prune(self, node: _Node | None) -> None:
        # A node with nothing to keep (no snapshot, no holder, no child) goes, and maybe its parent after it.
        while node is not None and node.refs <= 0 and node.snapshot is None and not node.children:
            del self._nodes[node.key]
            parent = node.parent
            if parent is not None:
                parent.children.discard(node.key)
            node = parent

    def attach(self, key: bytes, ref: SnapshotRef) -> list[tuple[bytes, SnapshotRef]]:
        """Record a snapshot of state ``key`` (which must be pinned); returns the ``(key, ref)`` pairs evicted to
        stay within budget, for the caller to discard (the new one may be among them if it alone exceeds it)."""
        node = self._nodes[key]
        evicted: list[tuple[bytes, SnapshotRef]] = []
        if node.snapshot is not None:
            evicted.append((key, node.snapshot))
            self._drop(node)
        node.snapshot = ref
        node.last_used = self.clock()
        self.snapshot_bytes += ref.size
        self.snapshots += 1
        return evicted + self.evict()

    def _drop(self, node: _Node) -> None:
        assert node.snapshot is not None
        self.snapshot_bytes -= node.snapshot.size
        self.snapshots -= 1
        node.snapshot = None

    def evict(self) -> list[tuple[bytes, SnapshotRef]]:
        """The snapshots no session can reach any more (``release_unreachable``), then the least recently used
        beyond the byte budget (never one a session stands on); the caller discards them."""
        evicted = []
        unreachable = [n for n in self._nodes.values() if n.snapshot is not None and not self.reachable(n.key)]
        for node in unreachable if self.release_unreachable else ():
            assert node.snapshot is not None
            evicted.append((node.key, node.snapshot))
            self._drop(node)
            self._prune(node)
        if self.snapshot_bytes <= self.snapshot_budget:
            return evicted
        candidates = sorted(
            (n for n in self._nodes.values() if n.snapshot is not None and n.refs <= 0), key=lambda n: n.last_used
        )
        for node in candidates:
            if self.snapshot_bytes <= self.snapshot_budget:
                break
            assert node.snapshot is not None
            evicted.append((node.key, node.snapshot))
            self._drop(node)
            self._prune(node)
        return evicted

    def drain(self) -> list[tuple[bytes, SnapshotRef]]:
        """Every snapshot, pinned or not (the cache is closing)."""
        out = []
        for node in list(self._nodes.values()):
            if node.snapshot is not None:
                out.append((node.key, node.snapshot))
                self._drop(node)
        return out
