"""``ClusterGroupRollout``: a group's set-up runs once, the base snapshot stays on its host and each rollout goes
where ``plan_group`` (``_placement``) says it starts soonest; every result reports its node, the choice and the
estimates (``PlacedResult``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import msgspec

from ..._fork._transfer import TransferStats
from ..._host._kernel import Limits
from ..._images._image import Image
from ..._rollout._rollout import Budget, GroupRollout, RolloutAgent, RolloutContext, RolloutResult, Task, prepare
from ._cluster import RayCluster
from ._handles import HostRef, RemoteSnapshot
from ._placement import Plan, mean_update, plan_group, with_bandwidth


class PlacedResult(RolloutResult):
    """A rollout's result with where it ran: ``node`` (host name), ``placement`` (``"base"``: forked on the
    host holding the base snapshot; ``"shipped"``: the snapshot was transferred to ``node``; ``"re-setup"``: the
    set-up ran again on ``node``) and the cost model's estimates in seconds (``estimates``: option -> start)."""

    node: str = ""
    placement: str = ""
    estimates: dict[str, float] = msgspec.field(default_factory=dict)


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
        # A cluster group always forks: its placement plans copies of one snapshot.
        super().__init__(task, n, agent, budget=budget, fork="always", image=image, limits=limits, reward=reward)
        self.cluster = cluster
        self.rollout_seconds = rollout_seconds
        """Expected rollout duration (s) for the queueing estimate; default the cluster's measured mean, or 10."""
        self.bandwidth = dict(bandwidth or {})
        """Bytes/s into each host (by name) from the base host, overriding what was measured."""
        self.plan: list[Plan] = []
        self.transfers: list[TransferStats] = []
        self.base_host: str | None = None

    async def _run_group(self) -> None:
        assert self._send is not None
        async with self._send:
            try:
                base_snap, setup = await self._setup()
                self.forked = True
            except Exception as exc:
                for i in range(self.n):
                    await self._send.send(self._failed(i, f"group set-up failed: {type(exc).__name__}: {exc}"))
                return
            sources: _Sources | None = None
            claims: list[str] = []
            try:
                async with self.cluster.deciding() as (infos, pending):
                    if self.bandwidth:
                        infos = [with_bandwidth(i, base_snap.host.name, self.bandwidth) for i in infos]
                    est = self.rollout_seconds or self.cluster.rollout_seconds or 10.0
                    self.plan = plan_group(
                        self.n, base_snap.host.name, infos, snapshot_bytes=base_snap.size, setup_seconds=setup,
                        rollout_seconds=est, pending=pending,
                    )  # fmt: skip
                    claims = [self.cluster.ledger.reserve(p.host) for p in self.plan]
                sources = _Sources(self, base_snap, self.plan)
                async with anyio.create_task_group() as tg:
                    for p, claim in zip(self.plan, claims, strict=True):
                        tg.start_soon(self._placed, p, sources, claim)
            finally:
                for claim in claims:  # a rollout that never started (cancelled) holds none
                    self.cluster.ledger.release(claim)
                with anyio.CancelScope(shield=True):
                    if sources is not None:
                        await sources.aclose()
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

    async def _placed(self, p: Plan, sources: _Sources, claim: str) -> None:
        assert self._send is not None
        t0 = time.monotonic()
        try:
            try:
                snap = await sources.by_host[p.host].get()
                (ws,) = await snap.from_snapshot(1, owner=self.cluster.owner, claim=claim)
            finally:
                self.cluster.ledger.release(claim)
                await sources.copied()
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
            self.cluster.rollout_seconds = mean_update(self.cluster.rollout_seconds, time.monotonic() - t0, 0.2)
        await self._send.send(self._placed_result(result, p))

    def _placed_result(self, r: RolloutResult, p: Plan) -> PlacedResult:
        fields = {f: getattr(r, f) for f in r.__struct_fields__}
        return PlacedResult(**fields, node=p.host, placement=p.placement, estimates=p.estimates)

    async def snapshot_on(self, host: HostRef, base: RemoteSnapshot, how: str) -> RemoteSnapshot:
        """The group's base snapshot on ``host``, got by ``how`` (``Placement``): the base itself, a transfer of it
        (recorded in ``transfers``), or the set-up run again there."""
        if how == "base":
            return base
        if how == "shipped":
            snap, stats = await self.cluster.fetch(base, host)
            if stats is not None:
                self.transfers.append(stats)
            return snap
        ws = await self.cluster.workspace(host, image=self.image, limits=self.limits)
        try:
            await prepare(ws, self.task)  # type: ignore[arg-type]
            return await ws.snapshot()
        finally:
            await ws.aclose()


class _Source:
    """The group's snapshot on one host, got once (``ClusterGroupRollout.snapshot_on``) for every rollout placed
    there; a failure to get it fails each of them."""

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
                    self._snap = await self.group.snapshot_on(self.host, self.base, self.how)
                except Exception as exc:
                    self._error = exc
                    raise
            return self._snap

    async def aclose(self) -> None:
        if self._snap is not None and self._snap is not self.base:
            await self._snap.aclose()


class _Sources:
    """The group's snapshots: the base and, per host, the one the rollouts placed there copy (``by_host``). Let go
    of as soon as every planned rollout has its copy or failed to get one (``copied``), not when the last rollout
    ends: nothing forks from them afterwards (a failed rollout is not retried; a rollout's cache captures and
    speculative forks snapshot its own workspace) and a copy-on-write copy keeps, on its host, the page image it
    maps itself. Held to the end, a snapshot would cost its bytes for the group's straggler's whole run."""

    def __init__(self, group: ClusterGroupRollout, base: RemoteSnapshot, plan: list[Plan]) -> None:
        self.base = base
        self.by_host: dict[str, _Source] = {}
        for p in plan:
            if p.host not in self.by_host:
                self.by_host[p.host] = _Source(group, base, group.cluster.host(p.host), p.placement)
        self.waiting = len(plan)
        self.closed = False

    async def copied(self) -> None:
        """One planned rollout has its copy (or will not get one); the last one lets the snapshots go."""
        self.waiting -= 1
        if self.waiting <= 0:
            await self.aclose()

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            for src in self.by_host.values():
                await src.aclose()
            await self.base.aclose()
