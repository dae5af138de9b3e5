"""The plain data the hosts and their clients exchange (no Ray here: the placement and its tests use it alone)."""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

import msgspec

DEFAULT_BANDWIDTH = 100 << 20
"""Bytes per second assumed for a host pair before a transfer between them was measured."""

NAMESPACE = "bunshin"
"""The Ray namespace of the host actors."""


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
    host (by name) into this one; ``memory_bytes``: what its workspaces and snapshots hold (``_accounting``), as of
    the host's last measurement (taken in the background, one at a time: a workspace decides how long a walk of its
    files takes)."""

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
    claims: tuple[str, ...] = ()
    """The claims (tokens a client sent with its requests: ``_placement.Ledger``) of the slots counted in
    ``waiting`` and ``in_use``: a client counts a reservation of its own only while its host does not list it."""


class Reply(msgspec.Struct):
    """What a host's method returns: its value, or the ``BunshinError`` it raised (pickled by the error's
    ``__reduce__`` and raised again by the caller, never wrapped in Ray's error)."""

    value: Any = None
    error: BaseException | None = None


def host_actor_name(name: str) -> str:
    """The Ray actor name of host ``name`` (in ``NAMESPACE``)."""
    return f"bunshin-host-{name}"


def owner_token() -> str:
    """A fresh owner identity: what a cluster's workspaces and snapshots are leased to."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
