"""``ToolCache`` (shared by many rollouts) and ``CachedSession`` (one rollout's view: its workspace and state chain;
its calls go through ``_calls.Calls``, its place in the state tree is a ``_position.Position``).

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
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._exceptions import InvalidValue, ToolCallError, ToolError
from .._runtime._handle import WorkspaceSlot
from .._tools._tools import CallClass, Effect, Tool, builtin_tools, lookup
from ._calls import CallRecord, Calls
from ._keys import SCHEMA_VERSION, BaseState, StateChain, encode_call, pure_key
from ._metrics import CacheMetrics
from ._position import Position
from ._shared import CacheState
from ._state import StateProvider, StateTree
from ._store import MemoryStore, Store

if TYPE_CHECKING:
    from .._workspace._facade import Workspace

__all__ = ["CachedSession", "CallRecord", "ToolCache"]


class ToolCache:
    """A tool prefix cache shared by the rollouts of one process (and, through its store, by other processes).

    ``store`` defaults to a 64 MiB in-memory LRU. ``provider`` enables write hits. ``audit_fraction`` of the
    read/pure hits (drawn with ``random.Random(audit_seed)``) are re-executed and compared. Snapshots captured here
    are kept within ``snapshot_budget`` bytes; writes shorter than ``capture_min_duration`` seconds are not captured
    (re-running them is cheaper than a restore). With ``release_unreachable`` a snapshot is held only while an
    open session could still ask for it (``StateTree``: set it when the sessions that share the cache open together,
    as a group's rollouts do; a capture then costs its bytes for as long as a sibling may use it, not for the whole
    run). With ``release_unreachable``, ``weigh_captures`` (on by default) also weighs a capture in byte-seconds
    before taking it: the siblings expected to ask for the state, each spared the write's run time with a rollout's
    memory, against the capture's bytes held until the last of them has passed (``_hold``; a skipped one is
    counted in ``metrics().captures_skipped_cost``). Use as ``async with ToolCache(...) as cache``.
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
        weigh_captures: bool = True,
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
            weigh_captures=weigh_captures,
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
        self.tools: dict[str, Tool] = {t.name: t for t in (builtin_tools() if tools is None else tools)}
        base = BaseState(
            schema=SCHEMA_VERSION,
            image=workspace.image.digest,
            workdir=workspace.workdir,
            env=dict(workspace.env),
            max_output=workspace.max_output,
            salt=salt,
        )
        chain = StateChain.root(base)
        for name, args in setup:
            tool = self.tools.get(name)
            norm = tool.normalize(args) if tool else dict(args)
            chain.advance(encode_call(name, tool.version if tool else "", norm))
        # the state it stands on and the current workspace (with whether the session closes it)
        self._pos = Position(self._shared, chain, WorkspaceSlot(workspace, own=own))
        self._calls = Calls(self._shared, self._pos, self.tools, capture=capture)
        self._lock = anyio.Lock()
        self._closed = False
        self.history: list[CallRecord] = []

    @property
    def capture(self) -> bool:
        """Whether this session's writes are snapshotted for its siblings."""
        return self._calls.capture

    # ------------------------------------------------------------------------------------------ public surface

    @property
    def workspace(self) -> Workspace:
        return self._pos.workspace

    def detach(self) -> Workspace:
        """The current workspace, from now on the caller's to close (the session stays usable)."""
        return self._pos.slot.detach()

    @property
    def state(self) -> str:
        """Hex name of the current state (equal across rollouts that made the same writes from the same base)."""
        return self._pos.key.hex()

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
            record = await self._calls.dispatch(t, norm, cls)
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
            key = self._pos.chain.write_key(call)
            return cache.flights.get(key) is not None or cache.tree.snapshot(key) is not None
        return cache.known(pure_key(call) if cls.effect is Effect.PURE else self._pos.chain.read_key(call))

    async def share(
        self,
        tool: str,
        args: Mapping[str, Any],
        run: Callable[[], Awaitable[tuple[Any, Any]]],
        take: Callable[[Any], Awaitable[bool]],
    ) -> tuple[Any, bool]:
        """A speculative read of ``tool`` run in place, at the session's state, through the cache's flight of
        speculative reads: sibling sessions that speculate the same read at once run it once (``SharedReads``).
        ``run`` runs it here (the outcome, the result or the ``ToolError``, and a token); a waiter is served the
        leader's outcome if ``take(token)`` accepts it (the runtime's pids: ``_runtime._branches.read_in_place``).
        Returns the outcome and whether ``run`` ran here. Nothing is stored or counted as a hit: the rollout that
        takes the result records it (``adopt``), as the cached plain loop's first asker would. Not under the
        session's lock: a read does not move the state, and the runtime ends its reads before a write runs."""
        t = lookup(self.tools, tool)
        norm = t.normalize(args)
        cls = t.classify_call(norm)
        if not cls.cacheable or cls.effect not in (Effect.READ, Effect.PURE):
            return (await run())[0], True
        call = encode_call(t.name, t.version, norm)
        key = pure_key(call) if cls.effect is Effect.PURE else self._pos.chain.read_key(call)
        outcome, seconds = await self._shared.reads.share(key, run, take)
        if seconds is not None:
            self._shared.metrics.reads_shared += 1
            self._shared.metrics.reads_shared_seconds += seconds
        return outcome, seconds is None

    async def move(self, workspace: Workspace) -> None:
        """Continue in ``workspace``, a speculative write's fork whose call still runs (owned by the session from now
        on, the previous workspace closed if owned): ``adopt`` of the same workspace records the call once it ended.
        Until then the session stands where it stood (the call's state is not known yet), as during a live write."""
        async with self._lock:
            await self._pos.slot.swap(workspace)

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
            await self._pos.slot.swap(workspace)  # first: whatever fails below, the fork has an owner
            if self._closed:
                raise ToolError("the cached session is closed", tool=tool)
            norm = t.normalize(args)
            record = await self._calls.adopt(t, norm, t.classify_call(norm), result, duration)
        self.history.append(record)
        return record

    async def aclose(self) -> None:
        """Unpin the session's state and close the workspace if the session owns it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._pos.leave()

    async def __aenter__(self) -> CachedSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
