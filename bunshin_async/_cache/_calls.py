"""One session's call pipeline: a call keyed on the session's state is served from the cache or run, and what it
did is recorded (``CallRecord``). Reads and pure calls are served from their recorded result (or deterministic
error); writes by restoring the snapshot captured after them, when a ``StateProvider`` can; identical calls in
flight are run once (single flight); a seeded share of hits is audited by running them again."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from .._exceptions import BunshinError, ToolError
from .._tools._tools import CallClass, Effect, Tool
from .._workspace._facade import Workspace, continue_pids, mark_pids, pid_cursor, pids_since_mark
from ._keys import encode_call, pure_key
from ._metrics import AuditMismatch
from ._position import Position
from ._records import CorruptRecord, Entry, entry_of, outcome_of
from ._shared import CacheState

log = logging.getLogger("bunshin_async.cache")

Source = Literal["executed", "cache", "shared", "restored", "uncacheable", "adopted"]

_MAX_MISMATCHES = 100


class CallRecord(msgspec.Struct, frozen=True):
    """What one call did. ``source``: ``executed`` (a miss), ``cache`` (a stored hit), ``shared`` (a concurrent
    identical call's result), ``restored`` (a write hit served by the state provider), ``uncacheable`` or
    ``adopted`` (run elsewhere, by a speculative branch, and handed to ``CachedSession.adopt``).
    ``duration`` is the recorded run time of the call (seconds), also for hits; ``key`` is the hex cache key."""

    tool: str
    effect: Effect
    source: Source
    result: Any
    duration: float
    key: str | None = None
    #: A write found in the cache but executed, because no ``StateProvider`` can restore its state.
    unserved_hit: bool = False

    @property
    def hit(self) -> bool:
        return self.source in ("cache", "shared", "restored")


def changes_state(tool: Tool, cls: CallClass) -> bool:
    """Whether a call of ``tool`` classed ``cls`` may change the workspace."""
    return cls.effect is Effect.WRITE or (cls.effect is Effect.EXTERNAL and tool.touches_workspace)


class Calls:
    """The pipeline of one session standing at ``pos`` in ``shared``'s tree, over ``tools`` (by name);
    ``capture``: whether its writes are snapshotted for siblings. One call at a time (the session's lock)."""

    def __init__(self, shared: CacheState, pos: Position, tools: Mapping[str, Tool], *, capture: bool) -> None:
        self.shared = shared
        self.pos = pos
        self.capture = capture
        self._decoders = {name: msgspec.msgpack.Decoder(t.result_type) for name, t in tools.items()}

    async def dispatch(self, tool: Tool, args: dict[str, Any], cls: CallClass) -> CallRecord:
        """Serve or run one call (``args`` normalized, ``cls`` its class)."""
        m = self.shared.metrics
        m.count_call(tool.name, cls.effect.value)
        call = encode_call(tool.name, tool.version, args)
        if not cls.cacheable:
            m.count_uncacheable(tool.name, cls.effect.value)
            try:
                result, duration = await self._execute(tool, args)
            finally:
                if changes_state(tool, cls):
                    await self.pos.taint()
            m.count_executed(tool.name, cls.effect.value, duration)
            return CallRecord(tool.name, cls.effect, "uncacheable", result, duration)
        if cls.effect is Effect.WRITE:
            return await self._write(tool, args, call)
        key = pure_key(call) if cls.effect is Effect.PURE else self.pos.chain.read_key(call)
        return await self._read(tool, args, cls.effect, key)

    async def _execute(self, tool: Tool, args: dict[str, Any]) -> tuple[Any, float]:
        if tool.handler is None:
            raise ToolError(f"tool {tool.name!r} has no handler", tool=tool.name)
        t0 = time.perf_counter()
        result = await tool.handler(self.pos.workspace, args)
        return result, time.perf_counter() - t0

    async def _run_for_entry(self, tool: Tool, args: dict[str, Any], effect: Effect) -> tuple[Entry | None, Any]:
        """Execute and build the entry. Returns ``(entry, result)``; ``entry`` is None when the outcome may not be
        cached (an unencodable result). A deterministic tool error becomes an entry; other errors propagate."""
        t0 = time.perf_counter()
        try:
            result, duration = await self._execute(tool, args)
        except ToolError as exc:
            entry = entry_of(tool.name, effect.value, exc, time.perf_counter() - t0)
            if entry is None:
                raise
            return entry, exc
        return entry_of(tool.name, effect.value, result, duration), result

    def _decode(self, tool: Tool, entry: Entry) -> Any:
        return outcome_of(entry, self._decoders[tool.name], tool.name)

    def _hit(
        self, tool: Tool, effect: Effect, entry: Entry, source: Source, key: bytes, *, shared: bool = False
    ) -> CallRecord:
        self.shared.metrics.count_hit(tool.name, effect.value, entry.duration, shared=shared or source == "shared")
        result = self._decode(tool, entry)
        if isinstance(result, BaseException):
            raise result
        return CallRecord(tool.name, effect, source, result, entry.duration, key.hex())

    def _miss(self, tool: Tool, effect: Effect, entry: Entry | None, duration: float | None) -> None:
        seconds = entry.duration if entry is not None else (duration or 0.0)
        self.shared.metrics.count_miss(tool.name, effect.value, seconds)

    async def _read(self, tool: Tool, args: dict[str, Any], effect: Effect, key: bytes) -> CallRecord:
        cache = self.shared
        while True:
            flight = cache.flights.get(key)
            if flight is not None:
                await flight.done.wait()
                if flight.entry is not None:
                    return self._hit(tool, effect, flight.entry, "shared", key)
                continue  # the leader failed without a result: go round, maybe as the leader
            entry = await cache.lookup(key)
            if entry is not None:
                try:
                    self._decode(tool, entry)
                except CorruptRecord:
                    cache.metrics.corrupt += 1
                    await cache.delete(key)
                    entry = None
            if entry is not None:
                if cache.audit_draw():
                    return await self._audit(tool, args, effect, key, entry)
                return self._hit(tool, effect, entry, "cache", key)
            if cache.flights.get(key) is not None:
                continue
            flight = cache.flights.lead(key)
            entry = None
            try:
                entry, result = await self._run_for_entry(tool, args, effect)
                if entry is not None:
                    await cache.put(key, entry)
            finally:
                cache.flights.finish(key, flight, entry)
            self._miss(tool, effect, entry, None)
            duration = entry.duration if entry is not None else 0.0
            if isinstance(result, BaseException):
                raise result
            return CallRecord(tool.name, effect, "executed", result, duration, key.hex())

    async def _audit(self, tool: Tool, args: dict[str, Any], effect: Effect, key: bytes, entry: Entry) -> CallRecord:
        """Re-execute a hit and compare; the live outcome is returned (it is the truth either way)."""
        m = self.shared.metrics
        m.audits += 1
        cached = self._decode(tool, entry)
        try:
            live, duration = await self._execute(tool, args)
        except ToolError as exc:
            live, duration = exc, 0.0

        def view(x: Any) -> Any:
            if isinstance(x, BaseException):
                return (type(x).__name__, str(x))
            return tool.fingerprint(x)

        if view(cached) != view(live):
            m.audit_mismatches += 1
            if len(m.mismatches) < _MAX_MISMATCHES:
                m.mismatches.append(AuditMismatch(tool.name, key.hex(), dict(args)))
        self._miss(tool, effect, None, duration)
        if isinstance(live, BaseException):
            raise live
        return CallRecord(tool.name, effect, "executed", live, duration, key.hex())

    # ------------------------------------------------------------------------------------------ writes

    async def _write(self, tool: Tool, args: dict[str, Any], call: bytes) -> CallRecord:
        cache = self.shared
        key = self.pos.chain.write_key(call)
        if cache.provider is None:
            # No way to restore a state: run it, but tell the metrics what a fork provider would have served.
            known = await cache.lookup(key)
            record = (await self._write_miss(tool, args, call, key, capture=False))[0]
            if known is not None:
                cache.metrics.write_hits_unserved += 1
                cache.metrics.write_seconds_unserved += known.duration
                record = msgspec.structs.replace(record, unserved_hit=True)
            return record
        while True:
            flight = cache.flights.get(key)
            if flight is not None:
                await flight.done.wait()
                if flight.entry is not None and flight.entry.snapshot is not None:
                    restored = await self._restore(tool, call, key, flight.entry, shared=True)
                    if restored is not None:
                        return restored
                    return (await self._write_miss(tool, args, call, key, capture=True))[0]
                if flight.entry is not None:
                    return (await self._write_miss(tool, args, call, key, capture=True))[0]
                continue
            entry = await cache.lookup(key)
            if entry is not None and entry.snapshot is not None:
                restored = await self._restore(tool, call, key, entry, shared=False)
                if restored is not None:
                    return restored
            if cache.flights.get(key) is not None:
                continue
            flight = cache.flights.lead(key)
            published: Entry | None = None
            try:
                record, published = await self._write_miss(tool, args, call, key, capture=True)
            finally:
                cache.flights.finish(key, flight, published)
            return record

    async def _write_miss(
        self, tool: Tool, args: dict[str, Any], call: bytes, key: bytes, *, capture: bool
    ) -> tuple[CallRecord, Entry | None]:
        """Run a write, advance the chain, capture the new state if asked, store the entry. A deterministic tool
        error is raised after all that (the error is the cached outcome); the entry is returned for waiters."""
        ws = self.pos.workspace
        captures = capture and self.capture and self.shared.provider is not None and isinstance(ws, Workspace)
        if captures:
            await mark_pids(ws)
        try:
            entry, result = await self._run_for_entry(tool, args, Effect.WRITE)
        except BaseException:
            await self.pos.taint()  # the call may have changed the workspace in a way nobody can name
            raise
        if entry is None:
            await self.pos.taint()
            self._miss(tool, Effect.WRITE, None, None)
            return CallRecord(tool.name, Effect.WRITE, "executed", result, 0.0, None), None
        await self.pos.advance(call)
        assert self.pos.key == key
        if captures:
            entry = await self.shared.capture(ws, key, entry, await pids_since_mark(ws))
        await self.shared.put(key, entry)
        self._miss(tool, Effect.WRITE, entry, None)
        if isinstance(result, BaseException):
            raise result
        return CallRecord(tool.name, Effect.WRITE, "executed", result, entry.duration, key.hex()), entry

    async def _restore(self, tool: Tool, call: bytes, key: bytes, entry: Entry, *, shared: bool) -> CallRecord | None:
        """Serve a write hit by restoring its snapshot; None when the provider could not (then the call runs)."""
        cache = self.shared
        assert cache.provider is not None and entry.snapshot is not None
        try:
            self._decode(tool, entry)
        except CorruptRecord:
            cache.metrics.corrupt += 1
            await cache.delete(key)
            return None
        tree = cache.tree
        tree.pin(key, self.pos.key, visit=False)  # the snapshot must outlive the restore
        tree.restoring(key, +1)
        t0 = time.perf_counter()
        try:
            # The snapshot's pid cursor is where the sibling that ran the write left its own: its history's, with
            # the reads it ran and this rollout was served (which took no pid here). The rollout goes on from its
            # own cursor, moved as far as the write moved the sibling's, as where the write had run here.
            here = self.pos.workspace
            own = await pid_cursor(here) if entry.pids is not None and isinstance(here, Workspace) else None
            try:
                ws = await cache.provider.restore(here, entry.snapshot)
            except BunshinError as exc:
                cache.metrics.restore_failures += 1
                log.warning("restoring a cached state failed: the call runs instead", exc_info=exc)
                return None
            if own is not None and entry.pids is not None and isinstance(ws, Workspace):
                await continue_pids(ws, own + entry.pids)
            cache.metrics.restores += 1
            cache.metrics.restore_seconds += time.perf_counter() - t0
            await self.pos.slot.swap(ws)
            await self.pos.advance(call)
        finally:
            tree.restoring(key, -1)
            tree.unpin(key, visit=False)
            await cache.discard(tree.evict())  # the last sibling that could use it has it now
        return self._hit(tool, Effect.WRITE, entry, "restored", key, shared=shared)

    # ------------------------------------------------------------------------------------------ adoption

    async def adopt(
        self, tool: Tool, args: dict[str, Any], cls: CallClass, outcome: Any, duration: float
    ) -> CallRecord:
        """Record a call that ran elsewhere (``outcome``: its result or ``ToolError``) as if it had run here."""
        m = self.shared.metrics
        m.count_call(tool.name, cls.effect.value)
        result = None if isinstance(outcome, ToolError) else outcome
        entry = entry_of(tool.name, cls.effect.value, outcome, duration) if cls.cacheable else None
        if entry is None:  # like a live run whose outcome may not be cached
            if changes_state(tool, cls):
                await self.pos.taint()
            if not cls.cacheable:
                m.count_uncacheable(tool.name, cls.effect.value)
            else:
                self._miss(tool, cls.effect, None, duration)
            return CallRecord(tool.name, cls.effect, "adopted", result, duration)
        call = encode_call(tool.name, tool.version, args)
        if cls.effect is Effect.WRITE:
            key = self.pos.chain.write_key(call)
            await self.pos.advance(call)
            ws = self.pos.workspace  # the branch's fork, which marked its pids before the call (``mark_pids``)
            known = self.shared.tree.snapshot(key)
            kept = known is not None or self.capture
            pids = await pids_since_mark(ws) if kept and isinstance(ws, Workspace) else None
            if known is not None:  # a sibling captured this state already: keep its snapshot in the entry
                entry = msgspec.structs.replace(entry, snapshot=known, pids=pids)  # the same write from one state
            elif self.capture:
                entry = await self.shared.capture(ws, key, entry, pids)
        else:
            key = pure_key(call) if cls.effect is Effect.PURE else self.pos.chain.read_key(call)
        await self.shared.put(key, entry)
        self._miss(tool, cls.effect, entry, None)
        return CallRecord(tool.name, cls.effect, "adopted", result, duration, key.hex())
