"""Sandboxes on a Ray cluster's workspace hosts (``E2BServer(ray=...)``, ``bunshin e2b serve --ray ADDRESS``),
through the Ray integration (``integrations.ray``): one ``WorkspaceHost`` per node owns its workspaces, the server
drives them through ``RemoteWorkspace`` handles under an owner of its own (a lease it renews while it runs: a server
that dies without closing leaves nothing once its lease runs out).

Placement. A new sandbox goes to the host with the most free slots, counting those placed and not yet made once
(the cluster's ``ledger``: a reservation counts until its host lists its claim) and decided one at a time, so that
concurrent creates spread evenly. A fork's copies are live forks on their parent's host
when it has free slots for all of them; else the parent is snapshotted once and the copies are placed by the
integration's cost model (``plan_group``: a restore on the parent's host while it has free slots or when one frees,
against shipping the snapshot to another host over the measured bandwidth), a sandbox's expected stay in its slot
being the parent's remaining timeout. A sandbox made from a snapshot (``create(snapshot_id)``, a resume, a built
template) is placed the same way, a host that already holds a copy of the snapshot costing nothing to ship to.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

import anyio
import msgspec

from .._exceptions import BunshinError, HostError, ImageError, InvalidArgument, WorkspaceClosed
from .._host._kernel import Limits
from .._host._protocol import ExecResult
from .._images._image import Image
from ..integrations._ray._placement import plan_group, room  # the cost model (pure; not public)
from ..integrations.ray import HostConfig, RayCluster, RemoteSnapshot, RemoteWorkspace
from ._backends import Handle, Snap, template_not_found

DEFAULT_SLOTS = 16
"""Workspaces a host started by the server runs at once (``HostConfig.max_workspaces``)."""


class RemoteHandle:
    """A sandbox's workspace on a host. A host that died or cannot be reached took the workspace with it: that is
    ``WorkspaceClosed`` here, as a local workspace whose init died. An error inside a live host (``HostCallError``)
    fails that call only: it passes as itself and the sandbox stays."""

    def __init__(self, ws: RemoteWorkspace) -> None:
        self.remote = ws

    @property
    def limits(self) -> Limits | None:
        """The limits the workspace's host made it with (``get_info``'s CPUs, memory and disk)."""
        return self.remote.limits

    @property
    def id(self) -> str:
        return self.remote.id

    @property
    def closed(self) -> bool:
        return self.remote.closed

    @property
    def node(self) -> str:
        return self.remote.node

    def _gone(self, exc: HostError) -> WorkspaceClosed:
        return WorkspaceClosed(f"workspace {self.id} is gone with its host: {exc}", workspace_id=self.id)

    @contextlib.contextmanager
    def _host(self) -> Iterator[None]:
        try:
            yield
        except HostError as exc:
            raise self._gone(exc) from exc

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> ExecResult:
        with self._host():
            return await self.remote.exec(cmd, cwd=cwd, stdin=stdin, timeout=timeout, user=user)

    async def spawn(
        self,
        cmd: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
    ) -> int:
        with self._host():
            return await self.remote.spawn(list(cmd), cwd=cwd, env=dict(env) if env else None, user=user)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        with self._host():
            return await self.remote.read_file(path, max_bytes=max_bytes)

    async def poll(self, pid: int) -> int | None:
        with self._host():
            return await self.remote.poll(pid)

    async def signal(self, pid: int, sig: int) -> None:
        with self._host():
            await self.remote.signal(pid, sig)

    async def configure(self, *, env: Mapping[str, str] | None = None, user: str | None = None) -> None:
        with self._host():
            await self.remote.configure(env=env, user=user)

    async def aclose(self) -> None:
        await self.remote.aclose()


class PlacedSnapshot:
    """A snapshot on its host and the copies of it shipped to others (by host name), closed together."""

    def __init__(self, origin: RemoteSnapshot) -> None:
        self.origin = origin
        self.copies: dict[str, RemoteSnapshot] = {origin.host.name: origin}
        self._locks: dict[str, anyio.Lock] = {}

    @property
    def id(self) -> str:
        return self.origin.id

    async def on(self, cluster: RayCluster, host: str) -> RemoteSnapshot:
        """The snapshot on ``host``, shipped there once."""
        async with self._locks.setdefault(host, anyio.Lock()):
            if host not in self.copies:
                self.copies[host], _ = await cluster.fetch(self.origin, cluster.host(host))
            return self.copies[host]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            copies, self.copies = list(self.copies.values()), {}
            for snap in copies:
                await snap.aclose()


class RayBackend:
    """Sandboxes on the hosts of ``hosts`` (a ``RayCluster``: the server makes an owner of its own over them), or
    of the Ray cluster at an address (``"auto"``, ``"ray://..."``, ``"HOST:PORT"``): then the server starts a
    host on every alive node (``slots`` workspaces each) and stops them when it stops."""

    def __init__(self, ray: RayCluster | str, *, slots: int = DEFAULT_SLOTS) -> None:
        if slots < 1:
            raise InvalidArgument(f"a Ray host needs at least one workspace slot, not {slots}", tool="e2b serve")
        self._address = ray if isinstance(ray, str) else None
        self._given = ray if isinstance(ray, RayCluster) else None
        self.slots = slots
        self._started: RayCluster | None = None
        self._cluster: RayCluster | None = None

    @property
    def cluster(self) -> RayCluster:
        if self._cluster is None:
            raise HostError("the server's Ray cluster is not open", host="*")
        return self._cluster

    async def open(self) -> None:
        hosts = self._given
        if hosts is None:
            hosts = self._started = await start_hosts(self._address or "auto", self.slots)
        cluster = RayCluster(hosts.hosts, lease_seconds=hosts.lease_seconds)
        try:
            await cluster.__aenter__()
        except BaseException:
            await self._stop_hosts()
            raise
        self._cluster = cluster

    async def aclose(self) -> None:
        cluster, self._cluster = self._cluster, None
        with anyio.CancelScope(shield=True):
            if cluster is not None:
                await cluster.__aexit__(None, None, None)  # frees what this owner made on every host
            await self._stop_hosts()

    async def _stop_hosts(self) -> None:
        started, self._started = self._started, None
        if started is None:
            return
        for h in started.hosts:
            try:
                await h.raw("shutdown")
            except HostError:
                pass
        import ray

        for h in started.hosts:
            ray.kill(h.actor)

    async def image(self, ref: str) -> str:
        return ref  # resolved by the host that runs it: each node has its own image store

    async def fresh(
        self, image: Image | str | None, *, env: Mapping[str, str], workdir: str, max_output: int
    ) -> RemoteHandle:
        try:  # on the roomiest host, decided in turn with every other placement (``RayCluster.deciding``)
            ws = await self.cluster.workspace(image=image, env=env, workdir=workdir, max_output=max_output)
        except ImageError as exc:
            raise template_not_found(str(image), exc) from exc
        return RemoteHandle(ws)

    async def snapshot(self, ws: Handle) -> PlacedSnapshot:
        assert isinstance(ws, RemoteHandle)
        return PlacedSnapshot(await ws.remote.snapshot())

    async def _place(self, snap: PlacedSnapshot, n: int, lifetime: float) -> dict[str, tuple[int, str]]:
        """How many of ``n`` copies of ``snap`` go to each host (``plan_group``), each host's share reserved in the
        cluster's ledger: host -> (copies, claim). The caller releases the claims."""
        base = snap.origin.host.name
        free_ship = {h: math.inf for h in snap.copies if h != base}  # a copy there already: nothing to ship
        async with self.cluster.deciding() as (infos, pending):
            infos = [
                msgspec.structs.replace(i, bandwidth={**i.bandwidth, base: free_ship[i.name]})
                if i.name in free_ship
                else i
                for i in infos
            ]
            plan = plan_group(
                n,
                base,
                infos,
                snapshot_bytes=snap.origin.size,
                setup_seconds=math.inf,  # a sandbox's state cannot be set up again elsewhere: restore or ship
                rollout_seconds=max(1.0, lifetime),
                pending=pending,
            )
            counts = Counter(p.host for p in plan)
            return {host: (k, self.cluster.ledger.reserve(host, k)) for host, k in counts.items()}

    async def _copies(self, snap: PlacedSnapshot, host: str, k: int, claim: str) -> list[Handle]:
        try:
            there = await snap.on(self.cluster, host)
            made = await there.from_snapshot(k, owner=self.cluster.owner, claim=claim)
        finally:
            self.cluster.ledger.release(claim)
        return [RemoteHandle(w) for w in made]

    async def restore(self, snap: Snap, n: int, lifetime: float) -> list[Handle]:
        assert isinstance(snap, PlacedSnapshot)
        out: list[Handle] = []
        placed = await self._place(snap, n, lifetime)
        try:
            for host, (k, claim) in placed.items():
                out += await self._copies(snap, host, k, claim)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for h in out:
                    await h.aclose()
            raise
        finally:
            for _, claim in placed.values():
                self.cluster.ledger.release(claim)
        return out

    async def _beside(self, ws: RemoteHandle, n: int) -> str | None:
        """A reservation of ``n`` slots on ``ws``'s host if it has them free now, else None."""
        async with self.cluster.deciding() as (infos, pending):
            home = next((i for i in infos if i.name == ws.node), None)
            if home is None or room(home, pending) < n:
                return None
            return self.cluster.ledger.reserve(ws.node, n)

    async def fork(self, ws: Handle, n: int, lifetime: float) -> list[Handle | BunshinError]:
        assert isinstance(ws, RemoteHandle)
        claim = await self._beside(ws, n)
        if claim is not None:  # live copies beside the parent
            try:
                with ws._host():
                    return [RemoteHandle(c) for c in await ws.remote.fork(n, claim=claim)]
            finally:
                self.cluster.ledger.release(claim)
        snap = await self.snapshot(ws)
        out: list[Handle | BunshinError] = []
        try:
            placed = await self._place(snap, n, lifetime)
            results: dict[str, list[Handle] | BunshinError] = {}

            async def place(host: str, k: int, claim: str) -> None:
                try:
                    results[host] = await self._copies(snap, host, k, claim)
                except BunshinError as exc:
                    results[host] = exc

            try:
                async with anyio.create_task_group() as tg:
                    for host, (k, claim) in placed.items():
                        tg.start_soon(place, host, k, claim)
            except BaseException:  # cancelled, or a host failed otherwise: the copies other hosts made go too
                with anyio.CancelScope(shield=True):
                    for got in results.values():
                        for h in got if not isinstance(got, BunshinError) else ():
                            await h.aclose()
                raise
            finally:
                for _, claim in placed.values():
                    self.cluster.ledger.release(claim)
            for host, (k, _) in placed.items():
                got = results[host]
                out += [got] * k if isinstance(got, BunshinError) else got
        finally:
            await snap.aclose()  # the copies hold the layers they need
        return out


async def start_hosts(address: str, slots: int) -> RayCluster:
    """Connect this process to the Ray cluster at ``address`` and start a workspace host on each alive node."""
    import ray

    if not ray.is_initialized():
        try:
            await anyio.to_thread.run_sync(lambda: ray.init(address=address, log_to_driver=False))
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise HostError(f"cannot join the Ray cluster at {address}: {exc}", host=address) from exc
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        raise HostError(f"the Ray cluster at {address} has no alive node", host="*")
    try:
        return await RayCluster.start({node: HostConfig(max_workspaces=slots) for node in nodes})
    except ValueError as exc:  # Ray refuses a second actor of one name
        raise HostError(
            f"workspace hosts already run on the Ray cluster at {address} (another server started them?): {exc}",
            host="*",
        ) from exc
