"""``ToolCache`` (shared by many rollouts) and ``CachedSession`` (one rollout's view: its workspace and state chain).

Every tool call of an agent loop goes through ``await session.call(name, args)``: the session classifies the call,
keys it on its state chain, looks it up, executes it on a miss, stores the entry, and advances the chain on writes.
What is served from the cache:

- ``pure`` and ``read`` calls: the recorded result (or the recorded deterministic error, e.g. ``FileNotFound``);
- ``write`` calls: only with a ``StateProvider`` (``ForkStateProvider``), by restoring the snapshot captured after
  the call; without one the write runs (and ``metrics().write_hits_unserved`` counts what a provider would have
  served). A restore costs about as much as a capture (a few hundred ms, see ``bench/cache_bench.py``): set
  ``capture_min_duration`` so that writes cheaper than that are re-run instead;
- ``external`` and nondeterministic calls: never. After a nondeterministic or failed write, or an external call
  that may touch the workspace, the session's chain moves to a state no other rollout can name.

Correctness rests on tools being deterministic functions of (state, call); ``audit_fraction`` re-executes a seeded
random share of hits and reports disagreements in ``metrics().audit_mismatches``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import msgspec

from .._exceptions import BunshinError, InvalidValue, ToolCallError, ToolError
from .._runtime._handle import WorkspaceSlot
from .._tools._tools import CallClass, Effect, Tool, builtin_tools, lookup
from ._keys import SCHEMA_VERSION, BaseState, StateChain, encode_call, pure_key
from ._metrics import AuditMismatch, CacheMetrics
from ._records import CorruptRecord, Entry, error_record, rebuild_error
from ._shared import CacheState
from ._state import StateProvider, StateTree
from ._store import MemoryStore, Store

if TYPE_CHECKING:
    from .._workspace._facade import Workspace

Source = Literal["executed", "cache", "shared", "restored", "uncacheable", "adopted"]

_result_encoder = msgspec.msgpack.Encoder()
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


class ToolCache:
    """A tool prefix cache shared by the rollouts of one process (and, through its store, by other processes).

    ``store`` defaults to a 64 MiB in-memory LRU. ``provider`` enables write hits. ``audit_fraction`` of the
    read/pure hits (drawn with ``random.Random(audit_seed)``) are re-executed and compared. Snapshots captured here
    are kept within ``snapshot_budget`` bytes; writes shorter than ``capture_min_duration`` seconds are not captured
    (re-running them is cheaper than a restore). With ``release_unreachable`` a snapshot is held only while an
    open session could still ask for it (``StateTree``: set it when the sessions that share the cache open together,
    as a group's rollouts do; a capture then costs its bytes for as long as a sibling may use it, not for the whole
    run). Use as ``async with ToolCache(...) as cache``.
    """

    def __init__(
        self,
        store: Store | None = None,
        provider: StateProvider | None = None,
        *,
        audit_fraction: float = 0.0,
        audit_seed: int = 0,
        snapshot_budget: int = 8 << 30,
        capture_min_duration: float = 0.0,
        release_unreachable: bool = False,
    ) -> None:
        if not 0.0 <= audit_fraction <= 1.0:
            raise InvalidValue(
                f"audit_fraction must be within [0, 1], not {audit_fraction!r}", argument="audit_fraction"
            )
        self._shared = CacheState(
            store if store is not None else MemoryStore(),
            provider,
            audit_fraction=audit_fraction,
            audit_seed=audit_seed,
            snapshot_budget=snapshot_budget,
            capture_min_duration=capture_min_duration,
            release_unreachable=release_unreachable,
        )
        self._closed = False

    async def __aenter__(self) -> ToolCache:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def session(
        self,
        workspace: Workspace,
        tools: Iterable[Tool] | None = None,
        *,
        setup: Sequence[tuple[str, Mapping[str, Any]]] = (),
        salt: str = "",
        own: bool = False,
        capture: bool = True,
    ) -> CachedSession:
        return CachedSession(self, workspace, tools, setup=setup, salt=salt, own=own, capture=capture)

    @property
    def store(self) -> Store:
        return self._shared.store

    @property
    def provider(self) -> StateProvider | None:
        return self._shared.provider

    @property
    def audit_fraction(self) -> float:
        return self._shared.audit_fraction

    @property
    def capture_min_duration(self) -> float:
        return self._shared.capture_min_duration

    def metrics(self) -> CacheMetrics:
        """A copy of the counters, with the store's own stats and the snapshot accounting filled in."""
        m = msgspec.convert(msgspec.to_builtins(self._shared.metrics), CacheMetrics)
        m.snapshots = self._shared.tree.snapshots
        m.snapshot_bytes = self._shared.tree.snapshot_bytes
        m.store = self._shared.store.stats()
        return m

    @property
    def tree(self) -> StateTree:
        return self._shared.tree

    async def aclose(self) -> None:
        """Discard the snapshots captured here (their entries go too) and close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._shared.discard(self._shared.tree.drain())
            await self._shared.store.aclose()


class CachedSession:
    """One rollout's tool calls through a ``ToolCache``.

    ``tools`` defaults to the built-in tools. ``setup`` lists calls already applied to ``workspace`` before the
    session (they are folded into the root state, not executed); ``salt`` separates otherwise identical bases (a
    task id when tasks share an image but differ in files the harness copied in).

    Calls of one session run one at a time, in order. With a ``StateProvider`` a write hit may replace the
    workspace: use ``session.workspace`` afterwards. Who closes what: the session owns the workspaces the provider
    made, and with ``own=True`` the one passed in too; it closes an owned workspace when a restore replaces it and
    the current one in ``aclose()``. ``detach()`` hands the current workspace to the caller (a rollout that still
    has to score it): the session closes it no more. ``capture=False`` never snapshots a write (when no other
    session can reuse this one's states, as a group of one rollout: a capture would only cost its dump and memory).
    """

    def __init__(
        self,
        cache: ToolCache,
        workspace: Workspace,
        tools: Iterable[Tool] | None = None,
        *,
        setup: Sequence[tuple[str, Mapping[str, Any]]] = (),
        salt: str = "",
        own: bool = False,
        capture: bool = True,
    ) -> None:
        self.cache = cache
        self._shared = cache._shared  # what the cache's sessions share (the cache's own: one module)
        self.capture = capture
        self._slot = WorkspaceSlot(workspace, own=own)  # the current workspace and whether the session closes it
        self.tools: dict[str, Tool] = {t.name: t for t in (builtin_tools() if tools is None else tools)}
        self._decoders = {name: msgspec.msgpack.Decoder(t.result_type) for name, t in self.tools.items()}
        base = BaseState(
            schema=SCHEMA_VERSION,
            image=workspace.image.digest,
            workdir=workspace.workdir,
            env=dict(workspace.env),
            max_output=workspace.max_output,
            salt=salt,
        )
        self._chain = StateChain.root(base)
        for name, args in setup:
            tool = self.tools.get(name)
            norm = tool.normalize(args) if tool else dict(args)
            self._chain.advance(encode_call(name, tool.version if tool else "", norm))
        self._state = self._chain.key
        self._shared.tree.pin(self._state)
        self._lock = anyio.Lock()
        self._closed = False
        self.history: list[CallRecord] = []

    # ------------------------------------------------------------------------------------------ public surface

    @property
    def workspace(self) -> Workspace:
        return self._slot.workspace

    def detach(self) -> Workspace:
        """The current workspace, from now on the caller's to close (the session stays usable)."""
        return self._slot.detach()

    @property
    def state(self) -> str:
        """Hex name of the current state (equal across rollouts that made the same writes from the same base)."""
        return self._state.hex()

    async def call(
        self, tool: str, args: Mapping[str, Any] | None = None, *, effect: Effect | str | None = None
    ) -> Any:
        """Run (or serve) one tool call and return its result; deterministic tool errors are raised as on a live
        run. ``effect`` overrides the tool's classification for this call."""
        return (await self.call_ex(tool, args, effect=effect)).result

    async def call_json(self, tool: str, arguments: str, *, index: int = 0) -> Any:
        """``call`` with the arguments as the model wrote them (a JSON object); ``ToolCallError`` when unusable."""
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"arguments of {tool} are not valid JSON: {exc}", tool_name=tool, index=index) from exc
        if not isinstance(args, dict):
            raise ToolCallError(f"arguments of {tool} must be a JSON object", tool_name=tool, index=index)
        return await self.call(tool, args)

    async def call_ex(
        self, tool: str, args: Mapping[str, Any] | None = None, *, effect: Effect | str | None = None
    ) -> CallRecord:
        """``call``, returning the ``CallRecord`` (also appended to ``history``)."""
        t = lookup(self.tools, tool)
        norm = t.normalize(args or {})
        cls = t.classify_call(norm)
        if effect is not None:
            cls = CallClass(Effect(effect), cls.deterministic)
        async with self._lock:
            if self._closed:
                raise ToolError("the cached session is closed", tool=tool)
            record = await self._dispatch(t, norm, cls)
        self.history.append(record)
        return record

    def would_hit(self, tool: str, args: Mapping[str, Any] | None = None) -> bool:
        """Whether ``call(tool, args)`` would now be served without running (a stored read or pure result, a write
        whose snapshot this process holds, or an identical call in flight). Cheap and synchronous (only in-memory
        layers of the store are asked), so it may say False for a call a slower layer would serve. For
        ``Speculation.skip``: a call the cache serves is not worth speculating."""
        t = self.tools.get(tool)
        if t is None or self._closed:
            return False
        try:
            norm = t.normalize(args or {})
        except ToolError:
            return False
        cls = t.classify_call(norm)
        if not cls.cacheable:
            return False
        call = encode_call(t.name, t.version, norm)
        cache = self._shared
        if cls.effect is Effect.WRITE:
            if cache.provider is None:
                return False
            key = self._chain.write_key(call)
            return cache.flights.get(key) is not None or cache.tree.snapshot(key) is not None
        return cache.known(pure_key(call) if cls.effect is Effect.PURE else self._chain.read_key(call))

    async def adopt(
        self, workspace: Workspace, tool: str, args: Mapping[str, Any], result: Any, duration: float
    ) -> CallRecord:
        """Account a call that ran elsewhere (a committed speculative branch) as if ``call`` had run it here: switch
        to ``workspace`` (a write's fork, owned by the session from now on; for a read or pure call the current
        workspace), advance the state chain for a write, and record ``result`` (the tool's result, or the
        ``ToolError`` it raised) under the call's key so sibling rollouts hit it. A write is captured by the state
        provider as a missed write would be (``capture_min_duration`` applies to ``duration``, seconds). Returns
        the ``CallRecord`` (also in ``history``); the ``ToolError`` is not raised."""
        t = lookup(self.tools, tool)
        async with self._lock:
            await self._slot.swap(workspace)  # first: whatever fails below, the fork has an owner
            if self._closed:
                raise ToolError("the cached session is closed", tool=tool)
            norm = t.normalize(args)
            record = await self._adopt(t, norm, t.classify_call(norm), result, duration)
        self.history.append(record)
        return record

    async def aclose(self) -> None:
        """Unpin the session's state and close the workspace if the session owns it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        tree = self._shared.tree
        tree.unpin(self._state)
        await self._shared.discard(tree.evict())
        await self._slot.aclose()

    async def __aenter__(self) -> CachedSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------------------------------ dispatch

    async def _dispatch(self, tool: Tool, args: dict[str, Any], cls: CallClass) -> CallRecord:
        m = self._shared.metrics
        ts, es = m.stats_for(tool.name, cls.effect.value)
        ts.calls += 1
        es.calls += 1
        call = encode_call(tool.name, tool.version, args)
        if not cls.cacheable:
            ts.uncacheable += 1
            es.uncacheable += 1
            changes_state = cls.effect is Effect.WRITE or (cls.effect is Effect.EXTERNAL and tool.touches_workspace)
            try:
                result, duration = await self._execute(tool, args)
            finally:
                if changes_state:
                    await self._move(self._chain.taint)
            ts.executed_seconds += duration
            es.executed_seconds += duration
            return CallRecord(tool.name, cls.effect, "uncacheable", result, duration)
        if cls.effect is Effect.WRITE:
            return await self._write(tool, args, call)
        key = pure_key(call) if cls.effect is Effect.PURE else self._chain.read_key(call)
        return await self._read(tool, args, cls.effect, key)

    async def _execute(self, tool: Tool, args: dict[str, Any]) -> tuple[Any, float]:
        if tool.handler is None:
            raise ToolError(f"tool {tool.name!r} has no handler", tool=tool.name)
        t0 = time.perf_counter()
        result = await tool.handler(self._slot.workspace, args)
        return result, time.perf_counter() - t0

    async def _run_for_entry(self, tool: Tool, args: dict[str, Any], effect: Effect) -> tuple[Entry | None, Any]:
        """Execute and build the entry. Returns ``(entry, result)``; ``entry`` is None when the outcome may not be
        cached (an unencodable result). A deterministic tool error becomes an entry; other errors propagate."""
        t0 = time.perf_counter()
        try:
            result, duration = await self._execute(tool, args)
        except ToolError as exc:
            rec = error_record(exc)
            if rec is None:
                raise
            duration = time.perf_counter() - t0
            return Entry(tool.name, effect.value, None, duration, time.time(), error=rec), exc
        try:
            raw = _result_encoder.encode(result)
        except (TypeError, msgspec.EncodeError):
            return None, result
        return Entry(tool.name, effect.value, raw, duration, time.time()), result

    def _decode(self, tool: Tool, entry: Entry) -> Any:
        """The result (or the exception to raise) an entry holds; raises ``CorruptRecord``."""
        if entry.error is not None:
            return rebuild_error(entry.error, tool.name)
        if entry.result is None:
            raise CorruptRecord("entry without a result")
        try:
            return self._decoders[tool.name].decode(entry.result)
        except msgspec.DecodeError as exc:  # the tool's result type changed without a version bump
            raise CorruptRecord(str(exc)) from exc

    def _hit(
        self, tool: Tool, effect: Effect, entry: Entry, source: Source, key: bytes, *, shared: bool = False
    ) -> CallRecord:
        m = self._shared.metrics
        ts, es = m.stats_for(tool.name, effect.value)
        for s in (ts, es):
            s.hits += 1
            s.shared += shared or source == "shared"
            s.saved_seconds += entry.duration
        m.hits += 1
        m.saved_seconds += entry.duration
        result = self._decode(tool, entry)
        if isinstance(result, BaseException):
            raise result
        return CallRecord(tool.name, effect, source, result, entry.duration, key.hex())

    def _miss(self, tool: Tool, effect: Effect, entry: Entry | None, duration: float | None) -> None:
        m = self._shared.metrics
        ts, es = m.stats_for(tool.name, effect.value)
        d = entry.duration if entry is not None else (duration or 0.0)
        for s in (ts, es):
            s.misses += 1
            s.executed_seconds += d
        m.misses += 1

    async def _read(self, tool: Tool, args: dict[str, Any], effect: Effect, key: bytes) -> CallRecord:
        cache = self._shared
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
        m = self._shared.metrics
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
        cache = self._shared
        key = self._chain.write_key(call)
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
        cache = self._shared
        try:
            entry, result = await self._run_for_entry(tool, args, Effect.WRITE)
        except BaseException:
            await self._move(self._chain.taint)  # the call may have changed the workspace in a way nobody can name
            raise
        if entry is None:
            await self._move(self._chain.taint)
            self._miss(tool, Effect.WRITE, None, None)
            return CallRecord(tool.name, Effect.WRITE, "executed", result, 0.0, None), None
        await self._move(lambda: self._chain.advance(call))
        assert self._state == key
        if capture:
            entry = await self._capture(key, entry)
        await cache.put(key, entry)
        self._miss(tool, Effect.WRITE, entry, None)
        if isinstance(result, BaseException):
            raise result
        return CallRecord(tool.name, Effect.WRITE, "executed", result, entry.duration, key.hex()), entry

    async def _restore(self, tool: Tool, call: bytes, key: bytes, entry: Entry, *, shared: bool) -> CallRecord | None:
        """Serve a write hit by restoring its snapshot; None when the provider could not (then the call runs)."""
        cache = self._shared
        assert cache.provider is not None and entry.snapshot is not None
        try:
            self._decode(tool, entry)
        except CorruptRecord:
            cache.metrics.corrupt += 1
            await cache.delete(key)
            return None
        tree = cache.tree
        tree.pin(key, self._state)  # the snapshot must outlive the restore
        tree.restoring(key, +1)
        t0 = time.perf_counter()
        try:
            try:
                ws = await cache.provider.restore(self._slot.workspace, entry.snapshot)
            except BunshinError:
                cache.metrics.restore_failures += 1
                return None
            cache.metrics.restores += 1
            cache.metrics.restore_seconds += time.perf_counter() - t0
            await self._slot.swap(ws)
            await self._move(lambda: self._chain.advance(call))
        finally:
            tree.restoring(key, -1)
            tree.unpin(key)
            await cache.discard(tree.evict())  # the last sibling that could use it has it now
        return self._hit(tool, Effect.WRITE, entry, "restored", key, shared=shared)

    async def _adopt(
        self, tool: Tool, args: dict[str, Any], cls: CallClass, outcome: Any, duration: float
    ) -> CallRecord:
        m = self._shared.metrics
        ts, es = m.stats_for(tool.name, cls.effect.value)
        ts.calls += 1
        es.calls += 1
        result = None if isinstance(outcome, ToolError) else outcome
        changes_state = cls.effect is Effect.WRITE or (cls.effect is Effect.EXTERNAL and tool.touches_workspace)
        entry: Entry | None = None
        if cls.cacheable:
            if isinstance(outcome, ToolError):
                rec = error_record(outcome)
                if rec is not None:
                    entry = Entry(tool.name, cls.effect.value, None, duration, time.time(), error=rec)
            else:
                try:
                    raw = _result_encoder.encode(outcome)
                except (TypeError, msgspec.EncodeError):
                    pass
                else:
                    entry = Entry(tool.name, cls.effect.value, raw, duration, time.time())
        if entry is None:  # like a live run whose outcome may not be cached
            if changes_state:
                await self._move(self._chain.taint)
            if not cls.cacheable:
                ts.uncacheable += 1
                es.uncacheable += 1
            else:
                self._miss(tool, cls.effect, None, duration)
            return CallRecord(tool.name, cls.effect, "adopted", result, duration)
        call = encode_call(tool.name, tool.version, args)
        cache = self._shared
        if cls.effect is Effect.WRITE:
            key = self._chain.write_key(call)
            await self._move(lambda: self._chain.advance(call))
            known = cache.tree.snapshot(key)
            if known is not None:  # a sibling captured this state already: keep its snapshot in the entry
                entry = msgspec.structs.replace(entry, snapshot=known)
            else:
                entry = await self._capture(key, entry)
        else:
            key = pure_key(call) if cls.effect is Effect.PURE else self._chain.read_key(call)
        await cache.put(key, entry)
        self._miss(tool, cls.effect, entry, None)
        return CallRecord(tool.name, cls.effect, "adopted", result, duration, key.hex())

    async def _capture(self, key: bytes, entry: Entry) -> Entry:
        """Snapshot the workspace as a write left it, if the write took long enough to be worth a restore; the
        returned entry references the snapshot, which the state tree now holds."""
        cache = self._shared
        provider = cache.provider
        if provider is None or not self.capture or entry.duration < cache.capture_min_duration:
            return entry
        if cache.tree.release_unreachable and not cache.tree.reachable(key):  # no other session could ask for it
            cache.metrics.captures_skipped += 1
            return entry
        try:
            ref = await provider.capture(self._slot.workspace)
        except BunshinError:
            cache.metrics.capture_failures += 1
            return entry
        cache.metrics.captures += 1
        await cache.discard(cache.tree.attach(key, ref))
        return msgspec.structs.replace(entry, snapshot=ref)

    async def _move(self, step: Any) -> None:
        """Apply ``step`` to the chain and move this session's pin to the new state (the old state's snapshot may
        then be evicted)."""
        old = self._state
        step()
        self._state = self._chain.key
        tree = self._shared.tree
        tree.pin(self._state, old)
        tree.unpin(old)
        await self._shared.discard(tree.evict())
