"""Rollouts across a Ray cluster: one ``WorkspaceHost`` actor per node, handles that proxy the Workspace API, and
snapshots that move between nodes (the ``ray`` extra: ``pip install 'bunshin[ray]'``).

::

    cluster = await RayCluster.start({node_id: HostConfig(max_workspaces=4) for node_id in node_ids})
    async with cluster:
        async with await cluster.workspace() as ws:          # a RemoteWorkspace on the least loaded host
            await ws.exec("make")
            copies = await ws.fork(4)                         # live copies, on ws's host
        async with ClusterGroupRollout(cluster, task, 8, agent) as group:
            async for r in group:                             # PlacedResult: r.node, r.placement
                ...

Ownership. A host actor owns its node's workspaces, snapshots and limiter (``HostConfig.max_workspaces``: a call
that would exceed it waits in the host's queue). Every workspace and snapshot has an owner (a ``RayCluster``: one
per driver or worker that makes them) holding a lease that the cluster renews while it is open
(``HostConfig.lease_seconds``); closing a handle frees its workspace at once, closing the cluster frees what it
made, and an owner that dies without closing (a killed driver) stops renewing, so the host frees its workspaces
when the lease runs out. Hosts started by ``RayCluster.start`` are the driver's actors and die with it; their
workspaces die with them (a workspace's processes die with the process that owns it, see ``_fork``), and a host
started again on that node collects what they left (``bunshin gc``).

Errors. A ``BunshinError`` raised in a host reaches the caller as itself (it is returned, pickled by its
``__reduce__``, and raised again), never wrapped in Ray's error; a host that died or cannot be reached is a
``HostError`` naming its node, raised only to the calls and rollouts that were on it.

Moving snapshots. ``RemoteSnapshot`` lives on its host; ``RayCluster.fetch(snap, host)`` makes the destination host
pull it from the source as a stream of ``bunshin_async.transfer`` frames (a Ray streaming generator with
back-pressure, so at most a few 4 MiB frames are in the object store at once), checked and installed there with
nothing half-imported on failure. Each host remembers what it fetched (by source), so a snapshot crosses to a node
once, and measures the bandwidth of each transfer, which the placement's cost model uses.

Placement (``ClusterGroupRollout``). A group's set-up runs once on the host with the most room, which snapshots it
(the base snapshot). Each rollout then goes where its estimated start is earliest: on the base host while it has
free slots (a restore), else on another host by shipping the snapshot (its bytes over the measured bandwidth from
the base host, paid once per host) or re-running the set-up there (the measured set-up time, once per host),
or queued on a host behind the rollouts already placed there (a rollout's expected duration per slot). Every
result reports its node, the choice and the estimates (``PlacedResult``).

Cache. A host with ``HostConfig.redis_url`` runs a ``ToolCache`` over Redis (the records are shared by every host)
whose write hits fork the captured snapshot: one captured on another node is fetched from it first
(``ClusterStateProvider``), so write hits are served on every node, not only where they were captured.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

import anyio
import msgspec

from .. import _gc
from .._cache._records import SnapshotRef
from .._exceptions import BunshinError, ForkError, HostError, InvalidValue, WorkspaceClosed
from .._fork import _layers
from .._fork._snapshot import Snapshot
from .._image import Image
from .._kernel import Limits
from .._protocol import DirEntry, ExecResult
from .._rollout import (
    Budget,
    GroupRollout,
    RolloutAgent,
    RolloutContext,
    RolloutResult,
    Task,
    WorkspaceLimiter,
    prepare,
)
from .._transfer import TransferStats, export_snapshot, import_snapshot
from .._workspace import Workspace
from ._require import require

require("ray", framework="Ray", extra="ray")  # a missing extra is CapabilityMissing naming it, not an ImportError

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

__all__ = [
    "ClusterGroupRollout",
    "ClusterStateProvider",
    "HostConfig",
    "HostInfo",
    "HostRef",
    "PlacedResult",
    "RayCluster",
    "RemoteSnapshot",
    "RemoteWorkspace",
    "WorkspaceHost",
    "plan_group",
]

DEFAULT_BANDWIDTH = 100 << 20
"""Bytes per second assumed for a host pair before a transfer between them was measured."""


class HostConfig(msgspec.Struct, frozen=True):
    """One host: its workspace limit, lease, Bunshin environment (``BUNSHIN_HOME``, ``BUNSHIN_RUNDIR``,
    ``BUNSHIN_SNAPDIR``, ``BUNSHIN_CGROUP_PARENT``, ``BUNSHIN_FORK_MODE``: set in the actor's process before it
    makes anything) and, for a tool cache shared by every host, a Redis URL."""

    max_workspaces: int = 8
    lease_seconds: float = 30.0
    env: dict[str, str] = msgspec.field(default_factory=dict)
    redis_url: str | None = None


class HostInfo(msgspec.Struct, frozen=True):
    """A host's state as the placement sees it. ``bandwidth``: measured bytes/s of transfers from each source
    host (by name) into this one."""

    name: str
    node_id: str
    hostname: str
    pid: int
    max_workspaces: int
    in_use: int
    waiting: int
    workspaces: int
    snapshots: int
    bandwidth: dict[str, float]
    memory_bytes: int
    lease_seconds: float = 30.0


class _Reply(msgspec.Struct):
    value: Any = None
    error: BaseException | None = None


def _owner_token() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class WorkspaceHost:
    """The actor that owns one node's workspaces (``ray.remote(WorkspaceHost)``; ``RayCluster.start`` places one
    per node). Its methods take and return plain values; every ``BunshinError`` is returned in a ``_Reply`` so
    that the caller raises it unchanged."""

    def __init__(self, name: str, config: HostConfig) -> None:
        os.environ.update(config.env)
        self.name = name
        self.config = config
        self.limiter = WorkspaceLimiter(config.max_workspaces)
        self.waiting = 0
        self.workspaces: dict[str, tuple[Workspace, str]] = {}  # handle id -> (current workspace, owner)
        self.snapshots: dict[str, tuple[Snapshot, str]] = {}
        self.fetched: dict[str, str] = {}  # "<source host>/<snapshot id>" -> local snapshot id (owned by the host)
        self._fetching: dict[str, anyio.Lock] = {}
        self.bandwidth: dict[str, float] = {}
        self.leases: dict[str, float] = {}
        self.sessions: dict[str, Any] = {}  # handle id -> CachedSession
        self._cache: Any = None
        self._reaper: asyncio.Task[None] | None = None
        _layers.prepare_snapshot_store()
        self.collected = _gc.collect()  # what a host killed on this node left behind

    # ------------------------------------------------------------------------------------------------ plumbing

    async def _run(self, fn: Callable[[], Awaitable[Any]]) -> _Reply:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        try:
            return _Reply(value=await fn())
        except BunshinError as exc:
            return _Reply(error=exc)

    def _ws(self, ws_id: str) -> Workspace:
        entry = self.workspaces.get(ws_id)
        if entry is None:
            raise WorkspaceClosed(f"workspace {ws_id} is closed (or not on host {self.name})", workspace_id=ws_id)
        session = self.sessions.get(ws_id)
        return session.workspace if session is not None else entry[0]

    def _snap(self, snap_id: str) -> Snapshot:
        entry = self.snapshots.get(snap_id)
        if entry is None and self._cache is not None:  # a capture of the tool cache, fetched by another host
            own = self._cache.provider._own.get(snap_id)
            entry = (own, "") if own is not None else None
        if entry is None:
            raise ForkError(f"snapshot {snap_id} is not held by host {self.name}", workspace_id="")
        return entry[0]

    async def _acquire(self, k: int) -> None:
        self.waiting += k
        try:
            await self.limiter.acquire(k)
        finally:
            self.waiting -= k

    def _adopt(self, ws: Workspace, owner: str) -> str:
        self.workspaces[ws.id] = (ws, owner)
        self.leases.setdefault(owner, time.monotonic() + self.config.lease_seconds)
        return ws.id

    async def _reap(self) -> None:
        """Free what owners that stopped renewing their lease made (a killed driver)."""
        while True:
            await anyio.sleep(max(0.05, self.config.lease_seconds / 4))
            now = time.monotonic()
            for owner in [o for o, deadline in self.leases.items() if deadline < now]:
                del self.leases[owner]
                await self._free_owner(owner)

    async def _free_owner(self, owner: str) -> None:
        for ws_id in [w for w, (_, o) in self.workspaces.items() if o == owner]:
            await self._close(ws_id)
        for snap_id in [s for s, (_, o) in self.snapshots.items() if o == owner]:
            await self._close_snapshot(snap_id)

    async def _close(self, ws_id: str) -> None:
        entry = self.workspaces.pop(ws_id, None)
        if entry is None:
            return
        with anyio.CancelScope(shield=True):
            session = self.sessions.pop(ws_id, None)
            if session is not None:
                await session.aclose()
            await entry[0].aclose()
            await self.limiter.release()

    async def _close_snapshot(self, snap_id: str) -> None:
        entry = self.snapshots.pop(snap_id, None)
        if entry is not None:
            with anyio.CancelScope(shield=True):
                await entry[0].aclose()

    # ------------------------------------------------------------------------------------------------ API

    async def info(self) -> HostInfo:
        from .._accounting import tree_bytes

        mem = 0
        for ws, _ in self.workspaces.values():
            cg = ws.cgroup
            if cg is not None:
                mem += cg.memory_usage() or 0
        snap_bytes = await anyio.to_thread.run_sync(tree_bytes, _layers.snapshot_dir())
        return HostInfo(
            name=self.name,
            node_id=ray.get_runtime_context().get_node_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            max_workspaces=self.limiter.max_workspaces,
            in_use=self.limiter.in_use,
            waiting=self.waiting,
            workspaces=len(self.workspaces),
            snapshots=len(self.snapshots),
            bandwidth=dict(self.bandwidth),
            memory_bytes=mem + snap_bytes,
            lease_seconds=self.config.lease_seconds,
        )

    async def renew(self, owner: str) -> None:
        self.leases[owner] = time.monotonic() + self.config.lease_seconds

    async def release_owner(self, owner: str) -> None:
        self.leases.pop(owner, None)
        await self._free_owner(owner)

    async def create(self, owner: str, image: Image | None, limits: Limits | None, env: dict[str, str]) -> _Reply:
        async def go() -> tuple[str, str]:
            await self._acquire(1)
            ws = Workspace(image, limits=limits, env=env)
            try:
                await ws.start()
            except BaseException:
                await self.limiter.release()
                raise
            return self._adopt(ws, owner), ws.fork_mode

        return await self._run(go)

    async def call(self, ws_id: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Reply:
        async def go() -> Any:
            if method not in _PROXIED:
                raise WorkspaceClosed(f"no such workspace method {method!r}", workspace_id=ws_id)
            ws = self._ws(ws_id)
            out = await getattr(ws, method)(*args, **kwargs)
            if method == "spawn":
                return out.pid
            return out

        return await self._run(go)

    async def close(self, ws_id: str) -> _Reply:
        return await self._run(lambda: self._close(ws_id))

    async def snapshot(self, ws_id: str, owner: str) -> _Reply:
        async def go() -> tuple[str, int]:
            snap = await self._ws(ws_id).snapshot()
            self.snapshots[snap.id] = (snap, owner)
            self.leases.setdefault(owner, time.monotonic() + self.config.lease_seconds)
            return snap.id, await _snapshot_bytes(snap)

        return await self._run(go)

    async def from_snapshot(self, snap_id: str, n: int, owner: str) -> _Reply:
        async def go() -> list[tuple[str, str]]:
            snap = self._snap(snap_id)
            await self._acquire(n)
            try:
                copies = await Workspace.from_snapshot(snap, n)
            except BaseException:
                await self.limiter.release(n)
                raise
            return [(self._adopt(c, owner), c.fork_mode) for c in copies]

        return await self._run(go)

    async def fork(self, ws_id: str, n: int, owner: str) -> _Reply:
        async def go() -> list[tuple[str, str]]:
            ws = self._ws(ws_id)
            await self._acquire(n)
            try:
                copies = await ws.fork(n)
            except BaseException:
                await self.limiter.release(n)
                raise
            return [(self._adopt(c, owner), c.fork_mode) for c in copies]

        return await self._run(go)

    async def close_snapshot(self, snap_id: str) -> _Reply:
        return await self._run(lambda: self._close_snapshot(snap_id))

    async def export(self, snap_id: str) -> AsyncIterator[bytes]:
        """The snapshot's transfer frames (a Ray streaming generator)."""
        async for frame in export_snapshot(self._snap(snap_id)):
            yield frame

    async def fetch(self, source: Any, source_name: str, snap_id: str, owner: str | None) -> _Reply:
        """Pull snapshot ``snap_id`` from host ``source`` (an actor handle) into this host; with ``owner`` None it
        is the host's own copy, remembered and handed out again for the same source snapshot."""

        async def go() -> tuple[str, int, TransferStats | None]:
            key = f"{source_name}/{snap_id}"
            if source_name == self.name:
                return snap_id, await _snapshot_bytes(self._snap(snap_id)), None
            lock = self._fetching.setdefault(key, anyio.Lock())
            async with lock:
                known = self.fetched.get(key)
                if known is not None and known in self.snapshots and owner is None:
                    return known, await _snapshot_bytes(self._snap(known)), None
                gen = source.export.options(num_returns="streaming", _generator_backpressure_num_objects=4).remote(
                    snap_id
                )
                snap, stats = await import_snapshot(_frames(gen, source_name))
                self.snapshots[snap.id] = (snap, owner or f"host-{self.name}")
                if owner is None:
                    self.fetched[key] = snap.id
                else:
                    self.leases.setdefault(owner, time.monotonic() + self.config.lease_seconds)
                old = self.bandwidth.get(source_name)
                self.bandwidth[source_name] = stats.bandwidth if old is None else 0.5 * (old + stats.bandwidth)
                return snap.id, stats.bytes, stats

        return await self._run(go)

    # ------------------------------------------------------------------------------------------------ cache

    async def cache_call(self, ws_id: str, tool: str, args: dict[str, Any]) -> _Reply:
        """Run a tool call through this host's tool cache (``HostConfig.redis_url``), in the session of the
        workspace; a write hit continues in a fork (the handle then names that fork)."""

        async def go() -> tuple[str, Any]:
            session = self.sessions.get(ws_id)
            if session is None:
                cache = await self._tool_cache()
                session = cache.session(self._ws(ws_id), own=True)
                self.sessions[ws_id] = session
            rec = await session.call_ex(tool, args)
            return rec.source, rec.result

        return await self._run(go)

    async def _tool_cache(self) -> Any:
        from ..cache import LayeredStore, MemoryStore, RedisStore, ToolCache

        if self._cache is None:
            if self.config.redis_url is None:
                raise BunshinError(f"host {self.name} has no redis_url: no shared tool cache")
            store = LayeredStore(MemoryStore(), RedisStore(self.config.redis_url))
            cache = ToolCache(store, ClusterStateProvider(self), capture_min_duration=0.0)
            await cache.__aenter__()
            self._cache = cache
        return self._cache

    async def cache_metrics(self) -> dict[str, Any]:
        if self._cache is None:
            return {}
        m = self._cache.metrics()
        out: dict[str, Any] = {k: v for k, v in msgspec.to_builtins(m).items() if isinstance(v, int)}
        out["last_restore_error"] = self._cache.provider.last_error
        return out

    # ------------------------------------------------------------------------------------------------ shutdown

    async def shutdown(self) -> list[str]:
        """Close everything this host holds; returns what is left of its workspaces (nothing, when all went
        well)."""
        with anyio.CancelScope(shield=True):
            for ws_id in list(self.workspaces):
                await self._close(ws_id)
            await self.forget()
            for snap_id in list(self.snapshots):
                await self._close_snapshot(snap_id)
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        return await self.leftovers()

    async def forget(self) -> None:
        """Close what the host keeps for itself: fetched snapshots and the tool cache with its captures."""
        with anyio.CancelScope(shield=True):
            for ws_id in list(self.sessions):
                session = self.sessions.pop(ws_id)
                ws = session.detach()
                self.workspaces[ws_id] = (ws, self.workspaces[ws_id][1])
                await session.aclose()
            if self._cache is not None:
                await self._cache.__aexit__(None, None, None)
                self._cache = None
            for key, snap_id in list(self.fetched.items()):
                del self.fetched[key]
                await self._close_snapshot(snap_id)

    async def leftovers(self) -> list[str]:
        """What of workspaces and snapshots is on this host's disk (blocking listing, small)."""
        snaps = _layers.snapshot_dir()
        layers = _layers.layers_dir()
        left = [f"snapshot {p.name}" for p in snaps.iterdir() if p != layers] if snaps.exists() else []
        from .. import _paths

        base = _paths.workspaces_dir()
        left += [f"dir {p.name}" for p in base.iterdir() if p.name != ".layers"] if base.exists() else []
        left += [f"layer {p.name}" for p in layers.iterdir()] if layers.exists() else []
        return left


_PROXIED = {"exec", "read_file", "read_text", "write_file", "list_dir", "remove", "spawn", "ping"}


async def _snapshot_bytes(snap: Snapshot) -> int:
    from .._accounting import tree_bytes

    size = await anyio.to_thread.run_sync(tree_bytes, snap.path)
    if snap.layer.is_dir():
        size += await anyio.to_thread.run_sync(tree_bytes, snap.layer)
    return int(size)


def _unwrap(exc: BaseException, host: str) -> BaseException:
    """A Ray error as what the caller should see: the ``BunshinError`` inside, or ``HostError``."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BunshinError):
        return cause
    if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError):
        return HostError(f"host {host} died or is unreachable: {type(exc).__name__}", host=host)
    if isinstance(exc, ray.exceptions.RayError):
        return HostError(f"host {host} failed: {exc}", host=host)
    return exc


async def _frames(gen: Any, source: str) -> AsyncIterator[bytes]:
    try:
        async for ref in gen:
            yield await ref
    except ray.exceptions.RayError as exc:
        raise _unwrap(exc, source) from exc


# ---------------------------------------------------------------------------------------------------- client


class HostRef:
    """A host actor as clients see it: its handle, its name and the owner calls are made for."""

    def __init__(self, actor: Any, name: str, node_id: str) -> None:
        self.actor = actor
        self.name = name
        self.node_id = node_id

    async def raw(self, method: str, *args: Any) -> Any:
        ref = getattr(self.actor, method).remote(*args)
        try:
            return await ref
        except ray.exceptions.RayError as exc:
            raise _unwrap(exc, self.name) from exc
        except BaseException:
            ray.cancel(ref)
            raise

    async def call(self, method: str, *args: Any) -> Any:
        reply = await self.raw(method, *args)
        assert isinstance(reply, _Reply)
        if reply.error is not None:
            raise reply.error
        return reply.value

    async def info(self) -> HostInfo:
        info = await self.raw("info")
        assert isinstance(info, HostInfo)
        return info

    def __repr__(self) -> str:
        return f"<HostRef {self.name}>"


class RemoteWorkspace:
    """A workspace on a host, driven through its actor: ``exec``, ``read_file``, ``read_text``, ``write_file``,
    ``list_dir``, ``remove``, ``spawn`` (returns the in-workspace pid), ``ping``, ``snapshot``, ``fork``,
    ``cache_call``, ``aclose`` (idempotent), with the errors a local ``Workspace`` raises. Picklable: pass it
    to another task or actor, the owner stays the cluster that made it."""

    def __init__(self, host: HostRef, ws_id: str, owner: str, fork_mode: str) -> None:
        self.host = host
        self.id = ws_id
        self.owner = owner
        self.fork_mode = fork_mode
        self.closed = False

    @property
    def node(self) -> str:
        return self.host.name

    async def _proxy(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise WorkspaceClosed(f"workspace {self.id} is closed", workspace_id=self.id)
        return await self.host.call("call", self.id, method, args, kwargs)

    async def exec(self, cmd: str | Sequence[str], **kwargs: Any) -> ExecResult:
        out = await self._proxy("exec", cmd, **kwargs)
        assert isinstance(out, ExecResult)
        return out

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        return bytes(await self._proxy("read_file", path, max_bytes=max_bytes))

    async def read_text(self, path: str) -> str:
        return str(await self._proxy("read_text", path))

    async def write_file(self, path: str, data: bytes | str, *, append: bool = False, mode: int | None = None) -> None:
        await self._proxy("write_file", path, data, append=append, mode=mode)

    async def list_dir(self, path: str = ".") -> list[DirEntry]:
        return list(await self._proxy("list_dir", path))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._proxy("remove", path, recursive=recursive)

    async def spawn(self, cmd: str | Sequence[str], **kwargs: Any) -> int:
        return int(await self._proxy("spawn", cmd, **kwargs))

    async def ping(self) -> int:
        return int(await self._proxy("ping"))

    async def cache_call(self, tool: str, args: dict[str, Any]) -> tuple[str, Any]:
        """A tool call through the host's shared tool cache: ``(source, result)``, ``source`` as in
        ``CallRecord`` (``"executed"``, ``"hit"``, ``"restored"``, ...)."""
        if self.closed:
            raise WorkspaceClosed(f"workspace {self.id} is closed", workspace_id=self.id)
        source, result = await self.host.call("cache_call", self.id, tool, args)
        return str(source), result

    async def snapshot(self) -> RemoteSnapshot:
        snap_id, size = await self.host.call("snapshot", self.id, self.owner)
        return RemoteSnapshot(self.host, snap_id, self.owner, size)

    async def fork(self, n: int = 1) -> list[RemoteWorkspace]:
        made = await self.host.call("fork", self.id, n, self.owner)
        return [RemoteWorkspace(self.host, w, self.owner, mode) for w, mode in made]

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self.host.call("close", self.id)
            except HostError:
                pass  # a dead host freed it already

    async def __aenter__(self) -> RemoteWorkspace:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<RemoteWorkspace {self.id} on {self.host.name}>"


class RemoteSnapshot:
    """A snapshot held by a host. ``size``: bytes of its directory and layer there."""

    def __init__(self, host: HostRef, snap_id: str, owner: str | None, size: int) -> None:
        self.host = host
        self.id = snap_id
        self.owner = owner
        self.size = size
        self.closed = False

    async def from_snapshot(self, n: int = 1, owner: str | None = None) -> list[RemoteWorkspace]:
        who = owner or self.owner
        assert who is not None
        made = await self.host.call("from_snapshot", self.id, n, who)
        return [RemoteWorkspace(self.host, w, who, mode) for w, mode in made]

    async def aclose(self) -> None:
        if self.closed or self.owner is None:  # a host's own (fetched) copy is the host's to keep
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self.host.call("close_snapshot", self.id)
            except HostError:
                pass

    async def __aenter__(self) -> RemoteSnapshot:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<RemoteSnapshot {self.id} on {self.host.name}>"


_HOST_ACTOR = ray.remote(WorkspaceHost)
NAMESPACE = "bunshin"


def _host_actor_name(name: str) -> str:
    return f"bunshin-host-{name}"


class RayCluster:
    """The client side: the hosts, an owner identity and its lease renewal (``async with cluster:``)."""

    def __init__(self, hosts: Sequence[HostRef], *, lease_seconds: float = 30.0) -> None:
        if not hosts:
            raise InvalidValue("a cluster needs at least one host", argument="hosts")
        self.hosts = list(hosts)
        self.owner = _owner_token()
        self.lease_seconds = lease_seconds
        self.pending: dict[str, int] = {}
        """Workspaces this client has placed on each host and not yet got (they are not in the host's count)."""
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.rollout_seconds: float | None = None
        """Measured mean rollout duration (updated by each group), for the placement's queueing estimate."""

    @classmethod
    async def start(
        cls, configs: Mapping[str, HostConfig], *, names: Mapping[str, str] | None = None, actor_options: Any = None
    ) -> RayCluster:
        """One ``WorkspaceHost`` on each node (Ray node id -> its config), pinned there, named
        ``bunshin-host-<name>`` in namespace ``bunshin`` (``names``: node id -> name; default the node id's first
        12 characters). They are this process's actors: they stop when it does."""
        hosts = []
        for node_id, config in configs.items():
            name = (names or {}).get(node_id, node_id[:12])
            actor = _HOST_ACTOR.options(
                name=_host_actor_name(name),
                namespace=NAMESPACE,
                num_cpus=0,
                max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                **(actor_options or {}),
            ).remote(name, config)
            hosts.append(HostRef(actor, name, node_id))
        for h in hosts:
            await h.info()  # constructed (and collected what a dead host there left)
        return cls(hosts, lease_seconds=min(c.lease_seconds for c in configs.values()))

    @classmethod
    def connect(cls, names: Sequence[str]) -> RayCluster:
        """A client of hosts started elsewhere (by name), with an owner identity of its own."""
        hosts = []
        for name in names:
            actor = ray.get_actor(_host_actor_name(name), namespace=NAMESPACE)
            hosts.append(HostRef(actor, name, ""))
        return cls(hosts)

    def host(self, name: str) -> HostRef:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    async def __aenter__(self) -> RayCluster:
        """Start renewing this owner's leases (a daemon thread: the lease must be renewed while the event loop
        is busy too, and a driver that dies stops it with itself), at a third of the shortest lease."""
        leases = [i.lease_seconds for i in await self.infos() if i is not None]
        self.lease_seconds = min([self.lease_seconds, *leases])
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name="bunshin-lease", daemon=True)
        self._renewer.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Stop renewing and free everything this owner made on every host."""
        self._stop.set()
        if self._renewer is not None:
            await anyio.to_thread.run_sync(self._renewer.join)
            self._renewer = None
        with anyio.CancelScope(shield=True):
            for h in self.hosts:
                try:
                    await h.raw("release_owner", self.owner)
                except HostError:
                    pass

    def _renew(self) -> None:
        while not self._stop.is_set():
            refs = [h.actor.renew.remote(self.owner) for h in self.hosts]
            for ref in refs:
                try:
                    ray.get(ref, timeout=self.lease_seconds)
                except ray.exceptions.RayError:
                    pass  # a dead host holds nothing of ours any more
            self._stop.wait(self.lease_seconds / 3)

    async def infos(self) -> list[HostInfo | None]:
        out: list[HostInfo | None] = []
        for h in self.hosts:
            try:
                out.append(await h.info())
            except HostError:
                out.append(None)
        return out

    async def workspace(
        self,
        host: HostRef | None = None,
        *,
        image: Image | None = None,
        limits: Limits | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RemoteWorkspace:
        """A fresh workspace on ``host`` (default: the live host with the most free slots)."""
        if host is None:
            host = await self._roomiest()
        self.pending[host.name] = self.pending.get(host.name, 0) + 1
        try:
            ws_id, mode = await host.call("create", self.owner, image, limits, dict(env or {}))
        finally:
            self.pending[host.name] -= 1
        return RemoteWorkspace(host, ws_id, self.owner, mode)

    async def _roomiest(self) -> HostRef:
        best: tuple[int, HostRef] | None = None
        for h, info in zip(self.hosts, await self.infos(), strict=True):
            if info is not None:
                room = info.max_workspaces - info.in_use - info.waiting - self.pending.get(h.name, 0)
                if best is None or room > best[0]:
                    best = (room, h)
        if best is None:
            raise HostError("no live host in the cluster", host="*")
        return best[1]

    async def fetch(
        self, snap: RemoteSnapshot, to: HostRef, *, shared: bool = False
    ) -> tuple[RemoteSnapshot, TransferStats | None]:
        """``snap`` on host ``to``: pulled from its host there (``shared``: as the host's own copy, fetched once
        per source snapshot and kept by the host; otherwise this cluster owns the copy). Stats are None when
        nothing moved."""
        if to.name == snap.host.name:
            return snap, None
        snap_id, size, stats = await to.call(
            "fetch", snap.host.actor, snap.host.name, snap.id, None if shared else self.owner
        )
        return RemoteSnapshot(to, snap_id, None if shared else self.owner, size), stats


# ---------------------------------------------------------------------------------------------------- placement

Placement = Literal["base", "shipped", "re-setup"]


class PlacedResult(RolloutResult):
    """A rollout's result with where it ran: ``node`` (host name), ``placement`` (``"base"``: forked on the
    host holding the base snapshot; ``"shipped"``: the snapshot was transferred to ``node``; ``"re-setup"``: the
    set-up ran again on ``node``) and the cost model's estimates in seconds (``estimates``: option -> start)."""

    node: str = ""
    placement: str = ""
    estimates: dict[str, float] = msgspec.field(default_factory=dict)


class _Plan(msgspec.Struct):
    rollout: int
    host: str
    placement: str
    estimates: dict[str, float]


def plan_group(
    n: int,
    base: str,
    infos: Sequence[HostInfo],
    *,
    snapshot_bytes: int,
    setup_seconds: float,
    rollout_seconds: float,
    restore_seconds: float = 0.1,
    default_bandwidth: float = DEFAULT_BANDWIDTH,
    pending: Mapping[str, int] | None = None,
) -> list[_Plan]:
    """Where each of a group's ``n`` rollouts goes (the cost model, see the module doc; pure, for tests). A
    rollout's cost on a host is when it can start: the one-off cost of getting the snapshot there (nothing on the
    base host; on another, the cheaper of shipping, ``snapshot_bytes`` over the measured bandwidth from ``base``,
    and re-running the set-up, paid by the first rollout placed there), a restore, and the wait for a slot:
    ``rollout_seconds`` for each full round of the host's slots already taken (``pending``: workspaces placed on
    each host by other groups that the host does not count yet)."""
    pending = pending or {}
    free = {i.name: max(0, i.max_workspaces - i.in_use - i.waiting - pending.get(i.name, 0)) for i in infos}
    slots = {i.name: i.max_workspaces for i in infos}
    placed = {i.name: 0 for i in infos}
    has = {base}
    how: dict[str, str] = {base: "base"}
    out = []
    for r in range(n):
        est: dict[str, float] = {}
        for i in infos:
            h = i.name
            ahead = placed[h] - free[h]  # rollouts already placed there that will wait for a slot
            wait = 0.0 if ahead < 0 else rollout_seconds * (1 + ahead // slots[h])
            if h in has:
                est[f"{h}:{how[h]}"] = wait + restore_seconds
            else:
                bw = i.bandwidth.get(base, default_bandwidth)
                est[f"{h}:shipped"] = max(wait, snapshot_bytes / bw) + restore_seconds
                est[f"{h}:re-setup"] = max(wait, setup_seconds) + restore_seconds
        choice = min(est, key=lambda k: (est[k], k.split(":")[0] != base))
        h, placement = choice.split(":", 1)
        has.add(h)
        how[h] = placement
        placed[h] += 1
        out.append(_Plan(r, h, placement, est))
    return out


def _with_bandwidth(info: HostInfo, base: str, override: Mapping[str, float]) -> HostInfo:
    if info.name not in override:
        return info
    return msgspec.structs.replace(info, bandwidth={**info.bandwidth, base: override[info.name]})


class ClusterGroupRollout(GroupRollout):
    """``GroupRollout`` over a ``RayCluster``: the set-up runs once, the base snapshot stays on its host and the
    rollouts are placed by ``plan_group``; agents run here against ``RemoteWorkspace`` handles (they offer the
    Workspace tool API). Yields ``PlacedResult``. A host that dies fails the rollouts placed on it (reason
    ``HostError``); the others finish."""

    def __init__(
        self,
        cluster: RayCluster,
        task: Task,
        n: int,
        agent: RolloutAgent,
        *,
        budget: Budget | None = None,
        image: Image | None = None,
        limits: Limits | None = None,
        rollout_seconds: float | None = None,
        bandwidth: Mapping[str, float] | None = None,
        reward: Callable[[Any, Task], Awaitable[tuple[float, str]]] | None = None,
    ) -> None:
        super().__init__(task, n, agent, budget=budget, image=image, limits=limits, reward=reward)
        self.cluster = cluster
        self.rollout_seconds = rollout_seconds
        """Expected rollout duration (s) for the queueing estimate; default the cluster's measured mean, or 10."""
        self.bandwidth = dict(bandwidth or {})
        """Bytes/s into each host (by name) from the base host, overriding what was measured."""
        self.plan: list[_Plan] = []
        self.transfers: list[TransferStats] = []
        self.base_host: str | None = None

    async def _run_group(self) -> None:
        assert self._send is not None
        async with self._send:
            try:
                base_snap, setup = await self._setup()
            except Exception as exc:
                for i in range(self.n):
                    await self._send.send(self._failed(i, f"group set-up failed: {type(exc).__name__}: {exc}"))
                return
            sources: dict[str, _Source] = {}
            try:
                infos = [i for i in await self.cluster.infos() if i is not None]
                if self.bandwidth:
                    infos = [_with_bandwidth(i, base_snap.host.name, self.bandwidth) for i in infos]
                est = self.rollout_seconds or self.cluster.rollout_seconds or 10.0
                self.plan = plan_group(
                    self.n, base_snap.host.name, infos, snapshot_bytes=base_snap.size, setup_seconds=setup,
                    rollout_seconds=est, pending=self.cluster.pending,
                )  # fmt: skip
                for p in self.plan:
                    self.cluster.pending[p.host] = self.cluster.pending.get(p.host, 0) + 1
                for p in self.plan:
                    if p.host not in sources:
                        sources[p.host] = _Source(self, base_snap, self.cluster.host(p.host), p.placement)
                async with anyio.create_task_group() as tg:
                    for p in self.plan:
                        tg.start_soon(self._placed, p, sources[p.host])
            finally:
                with anyio.CancelScope(shield=True):
                    for src in sources.values():
                        await src.aclose()
                    await base_snap.aclose()

    async def _setup(self) -> tuple[RemoteSnapshot, float]:
        t0 = time.monotonic()
        base = await self.cluster.workspace(image=self.image, limits=self.limits)
        self.base_host = base.node
        try:
            await prepare(base, self.task)  # type: ignore[arg-type]  # the Workspace tool API, proxied
            self.setup_seconds = time.monotonic() - t0
            return await base.snapshot(), self.setup_seconds
        finally:
            await base.aclose()

    async def _placed(self, p: _Plan, src: _Source) -> None:
        assert self._send is not None
        t0 = time.monotonic()
        try:
            try:
                snap = await src.get()
                (ws,) = await snap.from_snapshot(1, owner=self.cluster.owner)
            finally:
                self.cluster.pending[p.host] -= 1
        except Exception as exc:
            failed = self._failed(p.rollout, f"{type(exc).__name__}: {exc}")
            await self._send.send(self._placed_result(failed, p))
            return
        ctx = RolloutContext(self.task, p.rollout, ws, self.budget)  # type: ignore[arg-type]
        try:
            result = await self._drive(ctx)
        finally:
            with anyio.CancelScope(shield=True):
                await ctx.ws.aclose()
                await ws.aclose()
        if result.status == "finished":
            done = time.monotonic() - t0
            prev = self.cluster.rollout_seconds
            self.cluster.rollout_seconds = done if prev is None else 0.8 * prev + 0.2 * done
        await self._send.send(self._placed_result(result, p))

    def _placed_result(self, r: RolloutResult, p: _Plan) -> PlacedResult:
        fields = {f: getattr(r, f) for f in r.__struct_fields__}
        return PlacedResult(**fields, node=p.host, placement=p.placement, estimates=p.estimates)


class _Source:
    """The group's snapshot on one host, got once (by fork from the base, a transfer, or a set-up there)."""

    def __init__(self, group: ClusterGroupRollout, base: RemoteSnapshot, host: HostRef, how: str) -> None:
        self.group = group
        self.base = base
        self.host = host
        self.how = how
        self._lock = anyio.Lock()
        self._snap: RemoteSnapshot | None = None
        self._error: BaseException | None = None

    async def get(self) -> RemoteSnapshot:
        async with self._lock:
            if self._error is not None:
                raise self._error
            if self._snap is None:
                try:
                    self._snap = await self._make()
                except Exception as exc:
                    self._error = exc
                    raise
            return self._snap

    async def _make(self) -> RemoteSnapshot:
        cluster = self.group.cluster
        if self.how == "base":
            return self.base
        if self.how == "shipped":
            snap, stats = await cluster.fetch(self.base, self.host)
            if stats is not None:
                self.group.transfers.append(stats)
            return snap
        ws = await cluster.workspace(self.host, image=self.group.image, limits=self.group.limits)
        try:
            await prepare(ws, self.group.task)  # type: ignore[arg-type]
            return await ws.snapshot()
        finally:
            await ws.aclose()

    async def aclose(self) -> None:
        if self._snap is not None and self._snap is not self.base:
            await self._snap.aclose()


# ---------------------------------------------------------------------------------------------------- cache


class ClusterStateProvider:
    """The tool cache's ``StateProvider`` inside a host: captures are snapshots of that host, named
    ``<host>/<snapshot id>`` in the (shared) records; a write hit captured on another host fetches the snapshot
    from it (once: the host keeps its copy) and forks it here."""

    def __init__(self, host: WorkspaceHost) -> None:
        self.host = host
        self._own: dict[str, Snapshot] = {}
        self.last_error: str | None = None

    async def capture(self, ws: Workspace) -> SnapshotRef:
        snap = await ws.snapshot()
        self._own[snap.id] = snap
        return SnapshotRef(f"{self.host.name}/{snap.id}", await _snapshot_bytes(snap))

    async def restore(self, ws: Workspace, ref: SnapshotRef) -> Workspace:
        try:
            return await self._restore(ws, ref)
        except BunshinError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"  # the cache counts the failure and runs the call
            raise

    async def _restore(self, ws: Workspace, ref: SnapshotRef) -> Workspace:
        name, _, snap_id = ref.id.partition("/")
        if name == self.host.name:
            snap = self._own.get(snap_id)
            if snap is None:
                raise ForkError(f"snapshot {snap_id} was evicted", workspace_id=ws.id)
        else:
            try:
                source = ray.get_actor(_host_actor_name(name), namespace=NAMESPACE)
            except ValueError as exc:
                raise HostError(f"host {name} holding snapshot {snap_id} is gone", host=name) from exc
            reply = await self.host.fetch(source, name, snap_id, None)
            if reply.error is not None:
                raise reply.error
            local_id = reply.value[0]
            snap = self.host._snap(local_id)
        # The session swaps to the fork and closes the workspace it replaces: the handle's slot moves to the fork.
        (fork,) = await Workspace.from_snapshot(snap, 1)
        return fork

    async def discard(self, ref: SnapshotRef) -> None:
        name, _, snap_id = ref.id.partition("/")
        snap = self._own.pop(snap_id, None) if name == self.host.name else None
        if snap is not None:
            await snap.aclose()
