"""What the cache did: hits and misses per tool and effect class, time saved, bytes stored, audit results."""

from __future__ import annotations

import msgspec

from ._store import StoreStats


class ToolStats(msgspec.Struct, kw_only=True):
    """Counters for one tool or one effect class. Seconds are the calls' recorded run times."""

    calls: int = 0
    hits: int = 0
    shared: int = 0  # hits served by a concurrent identical call (single flight), counted in ``hits`` too
    misses: int = 0
    uncacheable: int = 0
    executed_seconds: float = 0.0
    saved_seconds: float = 0.0


class AuditMismatch(msgspec.Struct, frozen=True):
    """A served hit that differed from re-running the call (``ToolCache(audit_fraction=...)``); see ``metrics()``."""

    tool: str
    key: str
    args: dict[str, object]


class CacheMetrics(msgspec.Struct, kw_only=True):
    """A snapshot of a ``ToolCache``'s counters (``ToolCache.metrics()``)."""

    by_tool: dict[str, ToolStats] = msgspec.field(default_factory=dict)
    by_effect: dict[str, ToolStats] = msgspec.field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    saved_seconds: float = 0.0
    reads_shared: int = 0  # speculative reads served by a sibling's speculative run (``CachedSession.share``)
    reads_shared_seconds: float = 0.0  # the run time those runs took (not run again)
    corrupt: int = 0
    store_errors: int = 0
    bytes_written: int = 0
    #: Write calls found in the cache but executed because no ``StateProvider`` is set: what a fork provider
    #: would serve (and the run time it would save, before the cost of the restore).
    write_hits_unserved: int = 0
    write_seconds_unserved: float = 0.0
    restores: int = 0
    restore_failures: int = 0
    restore_seconds: float = 0.0
    captures: int = 0
    capture_failures: int = 0
    #: Slow writes not captured because no other session stood where it could ask for their state.
    captures_skipped: int = 0
    #: Slow writes not captured because holding the capture until the last sibling that could ask for it has passed
    #: was expected to cost more byte-seconds than the hits would save (``ToolCache(weigh_captures=True)``).
    captures_skipped_cost: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0
    snapshots_evicted: int = 0
    audits: int = 0
    audit_mismatches: int = 0
    mismatches: list[AuditMismatch] = msgspec.field(default_factory=list)
    store: StoreStats | None = None

    def stats_for(self, tool: str, effect: str) -> tuple[ToolStats, ToolStats]:
        t = self.by_tool.get(tool)
        if t is None:
            t = self.by_tool[tool] = ToolStats()
        e = self.by_effect.get(effect)
        if e is None:
            e = self.by_effect[effect] = ToolStats()
        return t, e

    def count_call(self, tool: str, effect: str) -> None:
        for s in self.stats_for(tool, effect):
            s.calls += 1

    def count_uncacheable(self, tool: str, effect: str) -> None:
        for s in self.stats_for(tool, effect):
            s.uncacheable += 1

    def count_executed(self, tool: str, effect: str, seconds: float) -> None:
        """Run time of a call that ran (an uncacheable one: misses count theirs in ``count_miss``)."""
        for s in self.stats_for(tool, effect):
            s.executed_seconds += seconds

    def count_hit(self, tool: str, effect: str, saved_seconds: float, *, shared: bool) -> None:
        """A served call: ``saved_seconds`` its recorded run time, ``shared`` when a concurrent identical call
        served it."""
        for s in self.stats_for(tool, effect):
            s.hits += 1
            s.shared += shared
            s.saved_seconds += saved_seconds
        self.hits += 1
        self.saved_seconds += saved_seconds

    def count_miss(self, tool: str, effect: str, seconds: float) -> None:
        """A cacheable call that ran (``seconds``: its run time)."""
        for s in self.stats_for(tool, effect):
            s.misses += 1
            s.executed_seconds += seconds
        self.misses += 1
