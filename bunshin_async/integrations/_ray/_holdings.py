"""What one host holds: its workspaces and snapshots, each leased to an owner, the owners' lease deadlines and the
slot limiter (``HostConfig.max_workspaces``). Bookkeeping only: the host closes what it takes out of here."""

from __future__ import annotations

import time

import anyio

from ..._exceptions import ForkError, WorkspaceClosed
from ..._fork._snapshot import Snapshot, record_of
from ..._rollout._rollout import WorkspaceLimiter
from ..._workspace._accounting import tree_bytes
from ..._workspace._facade import Workspace


class Holdings:
    """The host ``name``'s workspaces (handle id -> workspace, owner) and snapshots (id -> snapshot, owner), and
    when each owner's lease runs out (``lease_seconds`` after its last renewal)."""

    def __init__(self, name: str, max_workspaces: int, lease_seconds: float) -> None:
        self.name = name
        self.lease_seconds = lease_seconds
        self.limiter = WorkspaceLimiter(max_workspaces)
        self.waiting = 0
        """Slots asked for and not yet granted (callers queued on the limiter)."""
        self.workspaces: dict[str, tuple[Workspace, str]] = {}
        self.snapshots: dict[str, tuple[Snapshot, str]] = {}
        self.leases: dict[str, float] = {}  # owner -> monotonic deadline
        self.claims: dict[str, int] = {}
        """Claim (a client's reservation, ``_placement.Ledger``) -> the slots counted for it here (waiting or in
        use); reported in ``HostInfo.claims``, changed in the same step as ``waiting`` and the limiter's count."""
        self._claim_of: dict[str, str] = {}  # workspace id -> the claim it was made under

    def _count(self, claim: str | None, k: int) -> None:
        if claim is not None:
            left = self.claims.get(claim, 0) + k
            if left > 0:
                self.claims[claim] = left
            else:
                self.claims.pop(claim, None)

    async def acquire(self, k: int, claim: str | None = None) -> None:
        """Wait for ``k`` slots (counted in ``waiting`` meanwhile), for the request that sent ``claim``."""
        self.waiting += k
        self._count(claim, k)
        try:
            await self.limiter.acquire(k)
        except BaseException:
            self._count(claim, -k)
            raise
        finally:
            self.waiting -= k

    async def release(self, k: int = 1, claim: str | None = None) -> None:
        """Give back ``k`` slots that no workspace took (``claim``: what they were acquired for)."""
        self._count(claim, -k)
        await self.limiter.release(k)

    def lease(self, owner: str) -> None:
        """Start ``owner``'s lease if it has none (a first workspace or snapshot)."""
        self.leases.setdefault(owner, time.monotonic() + self.lease_seconds)

    def renew(self, owner: str) -> None:
        self.leases[owner] = time.monotonic() + self.lease_seconds

    def expired(self) -> list[str]:
        """The owners whose lease ran out, forgotten here (their workspaces and snapshots are the caller's to free)."""
        now = time.monotonic()
        gone = [o for o, deadline in self.leases.items() if deadline < now]
        for owner in gone:
            del self.leases[owner]
        return gone

    def adopt(self, ws: Workspace, owner: str, claim: str | None = None) -> str:
        """Hold ``ws`` for ``owner`` (its slot is already taken, for ``claim``); returns its handle id."""
        self.workspaces[ws.id] = (ws, owner)
        if claim is not None:
            self._claim_of[ws.id] = claim
        self.lease(owner)
        return ws.id

    def adopt_snapshot(self, snap: Snapshot, owner: str | None) -> str:
        """Hold ``snap`` for ``owner``; None: the host's own copy (a fetched one it hands out again), under no
        lease: the host closes it itself."""
        if owner is None:
            self.snapshots[snap.id] = (snap, f"host-{self.name}")
        else:
            self.snapshots[snap.id] = (snap, owner)
            self.lease(owner)
        return snap.id

    def workspace(self, ws_id: str) -> Workspace:
        """The workspace handle ``ws_id`` was made for, or ``WorkspaceClosed``."""
        entry = self.workspaces.get(ws_id)
        if entry is None:
            raise WorkspaceClosed(f"workspace {ws_id} is closed (or not on host {self.name})", workspace_id=ws_id)
        return entry[0]

    def replace(self, ws_id: str, ws: Workspace) -> None:
        """Handle ``ws_id`` now names ``ws`` (a cache session moved it to a fork), for the same owner."""
        self.workspaces[ws_id] = (ws, self.workspaces[ws_id][1])

    def snapshot(self, snap_id: str) -> Snapshot | None:
        entry = self.snapshots.get(snap_id)
        return None if entry is None else entry[0]

    def missing_snapshot(self, snap_id: str) -> ForkError:
        return ForkError(f"snapshot {snap_id} is not held by host {self.name}", workspace_id="")

    def owned_by(self, owner: str) -> tuple[list[str], list[str]]:
        """The ids of the workspaces and of the snapshots ``owner`` holds here."""
        return (
            [w for w, (_, o) in self.workspaces.items() if o == owner],
            [s for s, (_, o) in self.snapshots.items() if o == owner],
        )

    def pop(self, ws_id: str) -> Workspace | None:
        """Forget workspace ``ws_id`` (its slot is the caller's to ``limiter.release``)."""
        entry = self.workspaces.pop(ws_id, None)
        if entry is None:
            return None
        self._count(self._claim_of.pop(ws_id, None), -1)
        return entry[0]

    def pop_snapshot(self, snap_id: str) -> Snapshot | None:
        entry = self.snapshots.pop(snap_id, None)
        return None if entry is None else entry[0]


async def snapshot_bytes(snap: Snapshot) -> int:
    """Bytes of ``snap``'s directory and layer on this host (what keeping it costs, what moving it sends)."""
    rec = record_of(snap)
    size = await anyio.to_thread.run_sync(tree_bytes, rec.path)
    if rec.layer.is_dir():
        size += await anyio.to_thread.run_sync(tree_bytes, rec.layer)
    return int(size)
