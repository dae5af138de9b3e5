"""``CacheState``: what the sessions of one ``ToolCache`` share (the store of sealed records, the snapshot provider
and the tree of captured states, the calls in flight, the counters, the audit draw). The cache owns it and hands
it to each ``CachedSession``, which uses it through these methods only."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import anyio
import msgspec

from .._exceptions import BunshinError, StoreUnavailable
from .._workspace._accounting import workspace_memory
from ._flight import SharedReads, SingleFlight
from ._hold import Pace, capture_net
from ._metrics import CacheMetrics
from ._records import CorruptRecord, Entry, seal, unseal
from ._state import SnapshotRef, StateProvider, StateTree
from ._store import LayeredStore, MemoryStore, Store

if TYPE_CHECKING:
    from .._workspace._facade import Workspace

__all__ = ["CacheState"]


class CacheState:
    """See the module doc; the arguments are ``ToolCache``'s."""

    def __init__(
        self,
        store: Store,
        provider: StateProvider | None,
        *,
        audit_fraction: float,
        audit_seed: int,
        snapshot_budget: int,
        capture_min_duration: float,
        release_unreachable: bool = False,
        weigh_captures: bool = True,
    ) -> None:
        self.store = store
        self.provider = provider
        self.audit_fraction = audit_fraction
        self.capture_min_duration = capture_min_duration
        self.weigh_captures = weigh_captures
        self._audit_rng = random.Random(audit_seed)
        self.flights = SingleFlight()
        self.reads = SharedReads()  # speculative reads in flight (``CachedSession.share``)
        self.tree = StateTree(snapshot_budget, release_unreachable)
        self.metrics = CacheMetrics()
        self.pace = Pace()  # seconds between two state changes of a session (``_position.Position``)
        self._capture_ratio: float | None = None  # a capture's bytes over its rollout's, as last measured

    async def lookup(self, key: bytes) -> Entry | None:
        try:
            value = await self.store.get(key)
        except StoreUnavailable:
            self.metrics.store_errors += 1
            return None
        if value is None:
            return None
        try:
            return unseal(key, value)
        except CorruptRecord:
            self.metrics.corrupt += 1
            await self.delete(key)
            return None

    async def put(self, key: bytes, entry: Entry) -> None:
        value = seal(key, entry)
        try:
            await self.store.put(key, value)
        except StoreUnavailable:
            self.metrics.store_errors += 1
            return
        self.metrics.bytes_written += len(key) + len(value)

    async def delete(self, key: bytes) -> None:
        try:
            await self.store.delete(key)
        except StoreUnavailable:
            self.metrics.store_errors += 1

    async def discard(self, evicted: list[tuple[bytes, SnapshotRef]]) -> None:
        """Free snapshots the tree let go of, and their entries (useless without them). Shielded: a snapshot out of
        the tree is freed here or never."""
        with anyio.CancelScope(shield=True):
            for key, ref in evicted:
                self.metrics.snapshots_evicted += 1
                if self.provider is not None:
                    with anyio.move_on_after(30):
                        try:
                            await self.provider.discard(ref)
                        except BunshinError:
                            pass
                await self.delete(key)

    def audit_draw(self) -> bool:
        return self.audit_fraction > 0 and self._audit_rng.random() < self.audit_fraction

    def known(self, key: bytes) -> bool:
        """Whether ``key`` is in flight or in an in-memory layer of the store, without touching the store's LRU
        order or stats (other layers are not asked: this must not await)."""
        if self.flights.get(key) is not None:
            return True
        layers = self.store.layers if isinstance(self.store, LayeredStore) else (self.store,)
        return any(isinstance(layer, MemoryStore) and layer.holds(key) for layer in layers)

    async def capture(self, ws: Workspace, key: bytes, entry: Entry, pids: int | None = None) -> Entry:
        """Snapshot ``ws`` as a write left it (state ``key``), if the write took long enough to be worth a restore,
        another session could ask for the state and, with ``weigh_captures``, the hold pays (``pays``); the
        returned entry references the snapshot, which the tree now holds, and ``pids`` (how far the write moved
        ``ws``'s pid cursor). A failed capture is counted, not raised (the entry is then stored without a
        snapshot)."""
        if self.provider is None or entry.duration < self.capture_min_duration:
            return entry
        if self.tree.release_unreachable and not self.tree.reachable(key):  # no other session could ask for it
            self.metrics.captures_skipped += 1
            return entry
        rollout_bytes = await self.pays(ws, key, entry.duration)
        if rollout_bytes is None:
            self.metrics.captures_skipped_cost += 1
            return entry
        try:
            ref = await self.provider.capture(ws)
        except BunshinError:
            self.metrics.capture_failures += 1
            return entry
        self.metrics.captures += 1
        if rollout_bytes > 0:
            self._capture_ratio = ref.size / rollout_bytes
        await self.discard(self.tree.attach(key, ref))
        return msgspec.structs.replace(entry, snapshot=ref, pids=pids)

    async def pays(self, ws: Workspace, key: bytes, seconds: float) -> int | None:
        """Whether a capture of ``ws`` at ``key`` (a write of ``seconds``) is expected to save more byte-seconds
        than it holds (``_hold.capture_net``: the siblings that may ask for it, each spared ``seconds`` with
        a rollout as big as ``ws``, against the capture's bytes held until the last of them has passed). Returns
        ``ws``'s bytes as measured (0: not measured) when it pays or cannot be weighed, None when it cannot pay.
        Weighed only with ``release_unreachable`` (otherwise a capture is held for the cache's life, which the
        cache cannot foresee) and once the tree knows a sibling and a pace; a capture's bytes are taken as
        ``ws``'s until one was measured (``ForkStateProvider``'s ref size over the rollout's, last seen)."""
        pace = self.pace.value
        if not (self.weigh_captures and self.tree.release_unreachable) or pace is None:
            return 0
        waiters = self.tree.waiters(key)
        if not waiters:
            return 0
        rollout_bytes = await anyio.to_thread.run_sync(workspace_memory, ws)
        capture_bytes = rollout_bytes * (self._capture_ratio if self._capture_ratio is not None else 1.0)
        if capture_net(waiters, pace, seconds, rollout_bytes, capture_bytes) < 0:
            return None
        return rollout_bytes
