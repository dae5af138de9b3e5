"""The Ray integration's implementation (public surface: ``bunshin_async.integrations.ray``), one concern a module:

- ``_model``: plain data (host configuration and state, the actors' reply, names); no Ray;
- ``_placement``: where rollouts and workspaces go, pure functions over ``HostInfo``; no Ray;
- ``_remote``: Ray behind one interface: actor calls and streams, Ray's errors as ``HostError`` or the host's own;
- ``_holdings``: what one host holds (workspaces, snapshots, its slot limit, owners' leases);
- ``_fetches``: snapshots a host pulls from another, and the bandwidth each transfer measured;
- ``_hostcache``: a host's tool cache over Redis, whose write hits fetch their snapshot from the host that took it;
- ``_host``: the ``WorkspaceHost`` actor over those;
- ``_handles``: the client's handles (``HostRef``, ``RemoteWorkspace``, ``RemoteSnapshot``); ``_cluster``:
  ``RayCluster``; ``_group``: ``ClusterGroupRollout``.

Only ``_remote`` imports Ray (a missing extra is ``CapabilityMissing`` there); ``_model``, ``_placement`` and
``_holdings`` do not need it.
"""

from __future__ import annotations
