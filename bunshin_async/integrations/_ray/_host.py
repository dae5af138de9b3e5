"""The actor that owns one node's workspaces (``RayCluster.start`` places one per node).

Ownership. A host owns its node's workspaces, snapshots and limiter (``HostConfig.max_workspaces``: a call that
would exceed it waits in the host's queue). Every workspace and snapshot has an owner (a ``RayCluster``) holding a
lease that the cluster renews while it is open (``HostConfig.lease_seconds``); closing a handle frees its workspace
at once, closing the cluster frees what it made, and an owner that dies without closing (a killed driver) stops
renewing, so the host frees its workspaces when the lease runs out. A host started again on a node where one was
killed collects what it left (``bunshin gc``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from ..._exceptions import BunshinError, HostCallError, WorkspaceClosed
from ..._fork._snapshot import Snapshot
from ..._fork._transfer import TransferStats, export_snapshot
from ..._host import _paths, _snapstore
from ..._host._kernel import Limits
from ..._images._image import Image
from ..._workspace import _gc
from ..._workspace._accounting import held_memory
from ..._workspace._facade import BackgroundProcess, Workspace
from ._fetches import Fetches
from ._holdings import Holdings, snapshot_bytes
from ._hostcache import HostCache
from ._model import HostConfig, HostInfo, Reply
from ._remote import node_id

log = logging.getLogger(__name__)

PROXIED = frozenset({"exec", "read_file", "read_text", "write_file", "list_dir", "remove", "spawn", "ping"})
"""The ``Workspace`` methods a handle may call through ``WorkspaceHost.call``."""


async def _configure(ws: Workspace, env: dict[str, str] | None, user: str | None) -> None:
    if env:
        ws.env = {**ws.env, **env}
    if user is not None:
        ws.user = user


Made = tuple[str, str, Limits]
"""What a host answers for each workspace it made: its id, fork mode and limits."""

OPERATIONS: dict[str, Callable[..., Awaitable[Any]]] = {
    "poll": lambda ws, pid: BackgroundProcess(ws, pid).poll(),
    "signal": lambda ws, pid, sig: BackgroundProcess(ws, pid).signal(sig),
    "configure": _configure,
}
"""What else a handle may do through ``WorkspaceHost.call`` (not ``Workspace`` methods): a spawned process's poll
and signal (by its in-workspace pid), and the environment and default user of the workspace's later commands."""


class WorkspaceHost:
    """The actor that owns one node's workspaces (``ray.remote(WorkspaceHost)``). Its methods take and return
    plain values; every ``BunshinError`` is returned in a ``Reply`` so that the caller raises it unchanged, any other
    error as a ``HostCallError`` (a call that failed in a live host is not a dead host)."""

    def __init__(self, name: str, config: HostConfig) -> None:
        os.environ.update(config.env)
        self.name = name
        self.config = config
        self.held = Holdings(name, config.max_workspaces, config.lease_seconds)
        self.fetches = Fetches(self.held, self._snap)
        self.cache = HostCache(self.held, self.fetches, config.redis_url)
        self._reaper: asyncio.Task[None] | None = None
        self._memory: int | None = None  # the last reading of what the host holds (``_memory_bytes``)
        self._measuring: asyncio.Task[None] | None = None
        _snapstore.prepare_snapshot_store()
        self.collected = _gc.collect()  # what a host killed on this node left behind

    # ------------------------------------------------------------------------------------------------ plumbing

    async def _run(self, fn: Callable[[], Awaitable[Any]]) -> Reply:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        try:
            return Reply(value=await fn())
        except BunshinError as exc:
            return Reply(error=exc)
        except Exception as exc:  # this call failed, not the host: its workspaces stay (``HostError`` says gone)
            log.warning("host %s: a call failed", self.name, exc_info=True)
            error = type(exc).__name__
            return Reply(error=HostCallError(f"{error} in host {self.name}: {exc}", host=self.name, error=error))

    def _ws(self, ws_id: str) -> Workspace:
        ws = self.held.workspace(ws_id)
        moved = self.cache.workspace(ws_id)  # a write hit continued in a fork
        return ws if moved is None else moved

    def _snap(self, snap_id: str) -> Snapshot:
        # a capture of the tool cache, fetched by another host, is held by the cache
        snap = self.held.snapshot(snap_id)
        if snap is None:
            snap = self.cache.own(snap_id)
        if snap is None:
            raise self.held.missing_snapshot(snap_id)
        return snap

    async def _reap(self) -> None:
        """Free what owners that stopped renewing their lease made (a killed driver)."""
        while True:
            await anyio.sleep(max(0.05, self.config.lease_seconds / 4))
            for owner in self.held.expired():
                with contextlib.suppress(Exception):  # a close that failed must not stop the reaping for good
                    await self._free_owner(owner)

    async def _free_owner(self, owner: str) -> None:
        """Close everything ``owner`` holds here, each whatever the others' closes did; the first failure is
        raised after."""
        workspaces, snapshots = self.held.owned_by(owner)
        errors: list[Exception] = []
        for close, ids in ((self._close, workspaces), (self._close_snapshot, snapshots)):
            for one in ids:
                try:
                    await close(one)
                except Exception as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    async def _close(self, ws_id: str) -> None:
        ws = self.held.pop(ws_id)
        if ws is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                try:
                    await self.cache.close_session(ws_id)
                finally:
                    await ws.aclose()
            finally:  # out of ``held`` already: its slot is freed whatever the close did
                await self.held.release()

    async def _close_snapshot(self, snap_id: str) -> None:
        snap = self.held.pop_snapshot(snap_id)
        if snap is not None:
            with anyio.CancelScope(shield=True):
                await snap.aclose()

    async def _forks(
        self, n: int, owner: str, claim: str | None, make: Callable[[], Awaitable[list[Workspace]]]
    ) -> list[Made]:
        await self.held.acquire(n, claim)
        try:
            copies = await make()
        except BaseException:
            await self.held.release(n, claim)
            raise
        return [(self.held.adopt(c, owner, claim), c.fork_mode, c.limits) for c in copies]

    # ------------------------------------------------------------------------------------------------ API

    async def _measure(self) -> int:
        held = [ws for ws, _ in self.held.workspaces.values()]
        return int(await anyio.to_thread.run_sync(held_memory, held, [_snapstore.snapshot_dir()]))

    async def _refresh(self) -> None:
        try:
            self._memory = await self._measure()
        finally:
            self._measuring = None

    async def _memory_bytes(self) -> int:
        """The last reading of what the host holds, a new one started if none is under way. Measuring walks every
        workspace's upper dir and the snapshot store, so it takes as long as a workspace makes it (seconds for a
        sandbox of 200k empty files); ``info`` is on the path of every placement (every E2B create waits for
        it), so it never waits for a walk but the first."""
        if self._memory is None:
            self._memory = await self._measure()
        elif self._measuring is None:
            self._measuring = asyncio.get_running_loop().create_task(self._refresh())
        return self._memory

    async def info(self) -> HostInfo:
        memory = await self._memory_bytes()
        return HostInfo(
            name=self.name,
            node_id=node_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            max_workspaces=self.held.limiter.max_workspaces,
            in_use=self.held.limiter.in_use,
            waiting=self.held.waiting,
            workspaces=len(self.held.workspaces),
            snapshots=len(self.held.snapshots),
            bandwidth=dict(self.fetches.bandwidth),
            memory_bytes=memory,
            lease_seconds=self.config.lease_seconds,
            claims=tuple(self.held.claims),
        )

    async def renew(self, owner: str) -> None:
        self.held.renew(owner)

    async def release_owner(self, owner: str) -> None:
        self.held.leases.pop(owner, None)
        await self._free_owner(owner)

    async def create(
        self,
        owner: str,
        image: Image | str | None,
        limits: Limits | None,
        env: dict[str, str],
        workdir: str | None = None,
        max_output: int | None = None,
        claim: str | None = None,
    ) -> Reply:
        """A fresh workspace for ``owner``: ``(id, fork mode, limits)``. ``claim``: the client's reservation of the
        slot (``_placement.Ledger``), listed in ``info`` while the slot is counted here."""

        async def go() -> Made:
            await self.held.acquire(1, claim)
            more: dict[str, Any] = {} if max_output is None else {"max_output": max_output}
            try:  # the constructor refuses an unknown image name or a bad workdir: the slot is freed either way
                ws = Workspace(image, limits=limits, env=env, workdir=workdir, **more)
                await ws.start()
            except BaseException:
                await self.held.release(1, claim)
                raise
            return self.held.adopt(ws, owner, claim), ws.fork_mode, ws.limits

        return await self._run(go)

    async def call(self, ws_id: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        async def go() -> Any:
            if method in OPERATIONS:
                return await OPERATIONS[method](self._ws(ws_id), *args)
            if method not in PROXIED:
                raise WorkspaceClosed(f"no such workspace method {method!r}", workspace_id=ws_id)
            out = await getattr(self._ws(ws_id), method)(*args, **kwargs)
            return out.pid if method == "spawn" else out

        return await self._run(go)

    async def close(self, ws_id: str) -> Reply:
        return await self._run(lambda: self._close(ws_id))

    async def snapshot(self, ws_id: str, owner: str) -> Reply:
        async def go() -> tuple[str, int]:
            snap = await self._ws(ws_id).snapshot()
            return self.held.adopt_snapshot(snap, owner), await snapshot_bytes(snap)

        return await self._run(go)

    async def from_snapshot(self, snap_id: str, n: int, owner: str, claim: str | None = None) -> Reply:
        async def go() -> list[Made]:
            snap = self._snap(snap_id)
            return await self._forks(n, owner, claim, lambda: Workspace.from_snapshot(snap, n))

        return await self._run(go)

    async def fork(self, ws_id: str, n: int, owner: str, claim: str | None = None) -> Reply:
        async def go() -> list[Made]:
            ws = self._ws(ws_id)
            return await self._forks(n, owner, claim, lambda: ws.fork(n))

        return await self._run(go)

    async def close_snapshot(self, snap_id: str) -> Reply:
        return await self._run(lambda: self._close_snapshot(snap_id))

    async def export(self, snap_id: str) -> AsyncIterator[bytes]:
        """The snapshot's transfer frames (a Ray streaming generator)."""
        async for frame in export_snapshot(self._snap(snap_id)):
            yield frame

    async def fetch(self, source: Any, source_name: str, snap_id: str, owner: str | None) -> Reply:
        """Pull snapshot ``snap_id`` from host ``source`` (an actor handle) into this host; with ``owner`` None it
        is the host's own copy, remembered and handed out again for the same source snapshot."""

        async def go() -> tuple[str, int, TransferStats | None]:
            return await self.fetches.fetch(source, source_name, snap_id, owner)

        return await self._run(go)

    async def cache_call(self, ws_id: str, tool: str, args: dict[str, Any]) -> Reply:
        """Run a tool call through this host's tool cache (``HostConfig.redis_url``), in the session of the
        workspace; a write hit continues in a fork (the handle then names that fork)."""
        return await self._run(lambda: self.cache.call(ws_id, self._ws(ws_id), tool, args))

    async def cache_metrics(self) -> dict[str, Any]:
        return self.cache.metrics()

    # ------------------------------------------------------------------------------------------------ shutdown

    async def shutdown(self) -> list[str]:
        """Close everything this host holds; returns what is left of its workspaces (nothing, when all went
        well)."""
        with anyio.CancelScope(shield=True):
            for ws_id in list(self.held.workspaces):
                with contextlib.suppress(Exception):  # the others are closed all the same; ``leftovers`` says
                    await self._close(ws_id)
            await self.forget()
            for snap_id in list(self.held.snapshots):
                with contextlib.suppress(Exception):
                    await self._close_snapshot(snap_id)
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        if self._measuring is not None:
            self._measuring.cancel()
        return await self.leftovers()

    async def forget(self) -> None:
        """Close what the host keeps for itself: fetched snapshots and the tool cache with its captures."""
        with anyio.CancelScope(shield=True):
            for ws_id, ws in (await self.cache.forget()).items():
                self.held.replace(ws_id, ws)
            for snap_id in self.fetches.forget():
                await self._close_snapshot(snap_id)

    async def leftovers(self) -> list[str]:
        """What of workspaces and snapshots is on this host's disk (blocking listing, small)."""
        snaps = _snapstore.snapshot_dir()
        layers = _snapstore.layers_dir()
        left = [f"snapshot {p.name}" for p in snaps.iterdir() if p != layers] if snaps.exists() else []
        base = _paths.workspaces_dir()
        left += [f"dir {p.name}" for p in base.iterdir() if p.name != ".layers"] if base.exists() else []
        left += [f"layer {p.name}" for p in layers.iterdir()] if layers.exists() else []
        return left
