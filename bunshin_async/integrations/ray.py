"""Rollouts across a Ray cluster: one host actor per node, handles that proxy the Workspace API, and snapshots
that move between nodes (the ``ray`` extra: ``pip install 'bunshin[ray]'``; without it, importing this module
raises ``CapabilityMissing``).

::

    cluster = await RayCluster.start({node_id: HostConfig(max_workspaces=4) for node_id in node_ids})
    async with cluster:
        async with await cluster.workspace() as ws:          # a RemoteWorkspace on the least loaded host
            await ws.exec("make")
            copies = await ws.fork(4)                         # live copies, on ws's host
        async with ClusterGroupRollout(cluster, task, 8, agent) as group:
            async for r in group:                             # PlacedResult: r.node, r.placement
                ...

Ownership. A host owns its node's workspaces, snapshots and slot limit (``HostConfig.max_workspaces``); each is
leased to the ``RayCluster`` that made it, which renews the lease while it is open: closing a handle frees its
workspace, closing the cluster frees what it made, and a driver killed without closing stops renewing, so the host
frees its workspaces when the lease runs out (``HostConfig.lease_seconds``).

Errors. A ``BunshinError`` raised in a host reaches the caller as itself; a host that died or cannot be reached is
a ``HostError`` naming its node, raised only to the calls and rollouts that were on it.

Moving snapshots. ``RayCluster.fetch(snap, host)`` makes the destination host pull it from the source as a stream
of ``bunshin_async.transfer`` frames (with back-pressure), checked and installed there with nothing half-imported
on failure; each transfer's bandwidth feeds the placement's cost model.

Placement (``ClusterGroupRollout``). A group's set-up runs once; each rollout goes where its estimated start is
earliest: on the host holding the base snapshot while it has free slots, else on another host by shipping the
snapshot or re-running the set-up there, or queued. Every result reports its node, the choice and the estimates
(``PlacedResult``).

Cache. Hosts with ``HostConfig.redis_url`` share a tool cache whose write hits fetch the captured snapshot from
the node that took it.

The implementation is ``bunshin_async.integrations._ray`` (one concern a module).
"""

from __future__ import annotations

from .._public import publish as _publish
from ._ray._cluster import RayCluster
from ._ray._group import ClusterGroupRollout, PlacedResult
from ._ray._handles import HostRef, RemoteSnapshot, RemoteWorkspace
from ._ray._model import HostConfig, HostInfo

__all__ = [
    "ClusterGroupRollout",
    "HostConfig",
    "HostInfo",
    "HostRef",
    "PlacedResult",
    "RayCluster",
    "RemoteSnapshot",
    "RemoteWorkspace",
]

_publish(__name__, globals())
