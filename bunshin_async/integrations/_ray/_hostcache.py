"""A host's tool cache: a ``ToolCache`` over Redis (``HostConfig.redis_url``: the records are shared by every host)
whose write hits fork the captured snapshot. One captured on another node is fetched from it first
(``ClusterStateProvider``), so write hits are served on every node, not only where they were captured."""

from __future__ import annotations

from typing import Any

import msgspec

from ..._exceptions import BunshinError, ForkError, HostError
from ..._fork._snapshot import Snapshot
from ..._workspace._facade import Workspace
from ...cache import CachedSession, LayeredStore, MemoryStore, RedisStore, SnapshotRef, ToolCache
from ._fetches import Fetches
from ._holdings import Holdings, snapshot_bytes
from ._remote import lookup


class ClusterStateProvider:
    """The tool cache's ``StateProvider`` inside a host: captures are snapshots of that host, named
    ``<host>/<snapshot id>`` in the (shared) records; a write hit captured on another host fetches the snapshot
    from it (once: the host keeps its copy) and forks it here."""

    def __init__(self, held: Holdings, fetches: Fetches) -> None:
        self.held = held
        self.fetches = fetches
        self._own: dict[str, Snapshot] = {}
        self.last_error: str | None = None

    def own(self, snap_id: str) -> Snapshot | None:
        """A snapshot captured here, by id."""
        return self._own.get(snap_id)

    async def capture(self, ws: Workspace) -> SnapshotRef:
        snap = await ws.snapshot()
        self._own[snap.id] = snap
        return SnapshotRef(f"{self.held.name}/{snap.id}", await snapshot_bytes(snap))

    async def restore(self, ws: Workspace, ref: SnapshotRef) -> Workspace:
        try:
            return await self._restore(ws, ref)
        except BunshinError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"  # the cache counts the failure and runs the call
            raise

    async def _restore(self, ws: Workspace, ref: SnapshotRef) -> Workspace:
        name, _, snap_id = ref.id.partition("/")
        if name == self.held.name:
            snap = self._own.get(snap_id)
            if snap is None:
                raise ForkError(f"snapshot {snap_id} was evicted", workspace_id=ws.id)
        else:
            try:
                source = lookup(name)
            except ValueError as exc:
                raise HostError(f"host {name} holding snapshot {snap_id} is gone", host=name) from exc
            local_id, _, _ = await self.fetches.fetch(source, name, snap_id, None)
            snap = self.fetches.lookup(local_id)
        # The session swaps to the fork and closes the workspace it replaces: the handle's slot moves to the fork.
        (fork,) = await Workspace.from_snapshot(snap, 1)
        return fork

    async def discard(self, ref: SnapshotRef) -> None:
        name, _, snap_id = ref.id.partition("/")
        snap = self._own.pop(snap_id, None) if name == self.held.name else None
        if snap is not None:
            await snap.aclose()


class HostCache:
    """The cache sessions of a host's workspaces (by handle id) and the ``ToolCache`` they share, made at the first
    call (a host without ``redis_url`` has none: a call is then a ``BunshinError``)."""

    def __init__(self, held: Holdings, fetches: Fetches, redis_url: str | None) -> None:
        self.held = held
        self.fetches = fetches
        self.redis_url = redis_url
        self.sessions: dict[str, CachedSession] = {}
        self._cache: ToolCache | None = None
        self._provider: ClusterStateProvider | None = None

    def workspace(self, ws_id: str) -> Workspace | None:
        """The workspace handle ``ws_id``'s session continues in (a fork after a write hit), if it has a session."""
        session = self.sessions.get(ws_id)
        return None if session is None else session.workspace

    def own(self, snap_id: str) -> Snapshot | None:
        """A snapshot the cache captured here, by id."""
        return None if self._provider is None else self._provider.own(snap_id)

    async def call(self, ws_id: str, ws: Workspace, tool: str, args: dict[str, Any]) -> tuple[str, Any]:
        """``tool(args)`` in the session of handle ``ws_id`` (made on ``ws`` at its first call): ``(source,
        result)``."""
        session = self.sessions.get(ws_id)
        if session is None:
            session = (await self._tool_cache()).session(ws, own=True)
            self.sessions[ws_id] = session
        rec = await session.call_ex(tool, args)
        return rec.source, rec.result

    async def _tool_cache(self) -> ToolCache:
        if self._cache is None:
            if self.redis_url is None:
                raise BunshinError(f"host {self.held.name} has no redis_url: no shared tool cache")
            provider = ClusterStateProvider(self.held, self.fetches)
            cache = ToolCache(
                LayeredStore(MemoryStore(), RedisStore(self.redis_url)), provider, capture_min_duration=0.0
            )
            await cache.__aenter__()
            self._cache, self._provider = cache, provider
        return self._cache

    async def close_session(self, ws_id: str) -> None:
        """Close handle ``ws_id``'s session (and the workspace it continues in). Not shielded: the caller is."""
        session = self.sessions.pop(ws_id, None)
        if session is not None:
            await session.aclose()

    async def forget(self) -> dict[str, Workspace]:
        """Close every session and the cache with its captures; returns the workspace each handle continues in,
        now the caller's to hold. Not shielded: the caller is."""
        moved = {}
        for ws_id in list(self.sessions):
            session = self.sessions.pop(ws_id)
            moved[ws_id] = session.detach()
            await session.aclose()
        if self._cache is not None:
            await self._cache.__aexit__(None, None, None)
            self._cache = self._provider = None
        return moved

    def metrics(self) -> dict[str, Any]:
        """The cache's counters (empty before its first call) and the last restore failure."""
        if self._cache is None or self._provider is None:
            return {}
        m = self._cache.metrics()
        out: dict[str, Any] = {k: v for k, v in msgspec.to_builtins(m).items() if isinstance(v, int)}
        out["last_restore_error"] = self._provider.last_error
        return out
