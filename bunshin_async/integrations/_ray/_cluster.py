"""The client side of a cluster: its hosts, an owner identity and the renewal of that owner's leases."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anyio

from ..._exceptions import HostError, InvalidValue, UnknownHost
from ..._fork._transfer import TransferStats
from ..._host._kernel import Limits
from ..._images._image import Image
from . import _remote
from ._handles import HostRef, RemoteSnapshot, RemoteWorkspace, made_one
from ._host import WorkspaceHost
from ._model import HostConfig, HostInfo, owner_token
from ._placement import Ledger, roomiest


class RayCluster:
    """The client side: the hosts, an owner identity and its lease renewal (``async with cluster:``)."""

    def __init__(self, hosts: Sequence[HostRef], *, lease_seconds: float = 30.0) -> None:
        if not hosts:
            raise InvalidValue("a cluster needs at least one host", argument="hosts")
        self.hosts = list(hosts)
        self.owner = owner_token()
        self.lease_seconds = lease_seconds
        self.ledger = Ledger()
        """Slots this client has asked hosts for and not yet got, counted once with the hosts' own counts
        (``_placement.Ledger``); placements read it inside ``deciding``."""
        self._placing = anyio.Lock()
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
            actor = _remote.start(WorkspaceHost, name, node_id, config, actor_options)
            hosts.append(HostRef(actor, name, node_id))
        for h in hosts:
            await h.info()  # constructed (and collected what a dead host there left)
        return cls(hosts, lease_seconds=min(c.lease_seconds for c in configs.values()))

    @classmethod
    def connect(cls, names: Sequence[str]) -> RayCluster:
        """A client of hosts started elsewhere (by name), with an owner identity of its own."""
        return cls([HostRef(_remote.lookup(name), name, "") for name in names])

    def host(self, name: str) -> HostRef:
        """The host named ``name``; ``UnknownHost`` (a ``KeyError``) if the cluster has none."""
        for h in self.hosts:
            if h.name == name:
                return h
        known = tuple(h.name for h in self.hosts)
        raise UnknownHost(f"no host {name!r} in this cluster (its hosts: {', '.join(known)})", host=name, known=known)

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
            _remote.renew([h.actor for h in self.hosts], self.owner, self.lease_seconds)
            self._stop.wait(self.lease_seconds / 3)

    async def infos(self) -> list[HostInfo | None]:
        """Each host's state, None for a host that died."""
        out: list[HostInfo | None] = []
        for h in self.hosts:
            try:
                out.append(await h.info())
            except HostError:
                out.append(None)
        return out

    @contextlib.asynccontextmanager
    async def deciding(self) -> AsyncIterator[tuple[list[HostInfo], dict[str, int]]]:
        """One placement decision at a time: the live hosts' infos and the slots this client reserved that they do
        not count yet (``ledger.pending``). Reserve what is decided (``ledger.reserve``) before leaving, so that the
        next decision sees it."""
        async with self._placing:
            infos = [i for i in await self.infos() if i is not None]
            yield infos, self.ledger.pending(infos)

    async def workspace(
        self,
        host: HostRef | None = None,
        *,
        image: Image | str | None = None,
        limits: Limits | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        max_output: int | None = None,
    ) -> RemoteWorkspace:
        """A fresh workspace on ``host`` (default: the live host with the most free slots); ``image``,
        ``workdir`` and ``max_output`` as ``Workspace`` takes them (an image name is loaded by the host)."""
        if host is None:
            async with self.deciding() as (infos, pending):
                best = roomiest(infos, pending)  # the first of equals: creates alternate
                if best is None:
                    raise HostError("no live host in the cluster", host="*")
                host = self.host(infos[best].name)
                claim = self.ledger.reserve(host.name)
        else:
            claim = self.ledger.reserve(host.name)
        try:
            ws_id, mode, got = await host.make(
                "create",
                self.owner,
                image,
                limits,
                dict(env or {}),
                workdir,
                max_output,
                claim,
                release=made_one("close"),
            )
        finally:
            self.ledger.release(claim)
        return RemoteWorkspace(host, ws_id, self.owner, mode, got)

    async def fetch(
        self, snap: RemoteSnapshot, to: HostRef, *, shared: bool = False
    ) -> tuple[RemoteSnapshot, TransferStats | None]:
        """``snap`` on host ``to``: pulled from its host there (``shared``: as the host's own copy, fetched once
        per source snapshot and kept by the host; otherwise this cluster owns the copy). Stats are None when
        nothing moved."""
        if to.name == snap.host.name:
            return snap, None
        owner = None if shared else self.owner
        release = (lambda _: []) if shared else made_one("close_snapshot")  # a shared copy is the host's to keep
        snap_id, size, stats = await to.make("fetch", snap.host.actor, snap.host.name, snap.id, owner, release=release)
        return RemoteSnapshot(to, snap_id, owner, size), stats
