"""Quiescing a workspace for a dump: calls in flight finish, new ones wait, no host connection stays open (CRIU
cannot dump one), and one snapshot or rollback of a workspace runs at a time (``coordinator``)."""

from __future__ import annotations

import os
import weakref

import anyio

from .._exceptions import ForkError
from .._host._client import AgentClient
from .._host._kernel import Cgroup
from .._host._pidcursor import MAX_TASKS
from .._workspace._core import WorkspaceCore
from ._record import SnapshotRecord

DRAIN_TIMEOUT = 60.0
MAX_DESCRIPTORS = 1 << 16
"""Descriptors of the workspace's processes the look for host connections reads (one readlink each, ~0.5 us): the
guest decides how many it holds, and past this bound a snapshot fails rather than take the host's time."""


def _pids(cgroup: Cgroup) -> list[int] | None:
    """The tree's pids from its freezer cgroup alone (the one CRIU freezes: every task of the tree is in it), one
    read where ``pids()`` reads each controller's (a v1 workspace has six; 0.1 ms of the drain here). None past
    ``MAX_TASKS`` pids' worth of bytes: the guest makes the list (``Limits(pids=None)`` bounds nothing)."""
    d = cgroup.freezer_dir
    if d is None:
        return cgroup.pids()
    try:
        with open(d / "cgroup.procs", "rb") as f:
            data = f.read(MAX_TASKS * 8 + 1)
    except OSError:
        return cgroup.pids()
    return [int(x) for x in data.split()] if len(data) <= MAX_TASKS * 8 else None


def _host_connections(ws: WorkspaceCore) -> int | None:
    """Sockets held by the workspace's processes that live in the host's net namespace: the agent's ends of host
    connections (an accepted Unix socket takes its net namespace from the connecting side, af_unix.c
    ``unix_stream_connect``), which CRIU cannot dump. None when the workspace holds more tasks or descriptors than
    the look reads (``MAX_DESCRIPTORS``). Blocking."""
    if ws.cgroup is None:
        return 0
    pids = _pids(ws.cgroup)
    if pids is None:
        return None
    held: set[str] = set()
    budget = MAX_DESCRIPTORS
    for pid in pids:
        try:
            with os.scandir(f"/proc/{pid}/fd") as fds:
                for fd in fds:
                    budget -= 1
                    if budget < 0:
                        return None
                    try:
                        link = os.readlink(fd.path)
                    except OSError:
                        continue
                    if link.startswith("socket:["):
                        held.add(link[8:-1])
        except OSError:
            continue
    if not held:
        return 0
    with open("/proc/self/net/unix") as f:  # the host's own table: not the guest's to grow
        next(f)
        return sum(1 for line in f if line.split()[6] in held)


async def drain(ws: WorkspaceCore) -> AgentClient:
    """Hold new calls and wait out those in flight (``AgentClient.quiesce``); the caller ``resume``s the client. On
    any failure, cancellation included, it is resumed here."""
    gated = ws.client
    if gated is None:
        raise ws.closed_error()
    try:
        with anyio.move_on_after(DRAIN_TIMEOUT) as scope:
            await gated.quiesce()
            # A connection closed without the agent's end-of-file seen: look through the workspace's descriptors
            # (0.3 ms; in a worker thread, as the guest decides how many there are). The end-of-file is the guest's
            # word: one that sent it and kept a copy of its end (or of ours) fails CRIU's dump on that socket.
            if not gated.all_closed():
                delay = 0.0005
                while held := await anyio.to_thread.run_sync(_host_connections, ws):  # gone once it read our hang-up
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.02)
                if held is None:
                    raise ForkError(
                        f"workspace {ws.id}: more than {MAX_TASKS} tasks or {MAX_DESCRIPTORS} descriptors to look "
                        "through for a host connection",
                        workspace_id=ws.id,
                    )
                gated.seen_closed()
    except BaseException:
        gated.resume()
        raise
    if scope.cancelled_caught:
        gated.resume()
        raise ForkError(f"workspace {ws.id}: tool calls did not finish within {DRAIN_TIMEOUT} s", workspace_id=ws.id)
    return gated


class Batch:
    """Concurrent ``fork`` calls on one workspace that share one snapshot (``snap``, or the ``error`` its taking
    raised, once ``taken`` is set); each caller restores its own copies from it, and the last one to finish
    closes it."""

    def __init__(self) -> None:
        self.users = 0
        self.taken = anyio.Event()
        self.snap: SnapshotRecord | None = None
        self.error: BaseException | None = None

    async def leave(self) -> None:
        self.users -= 1
        if self.users == 0 and self.snap is not None:
            with anyio.CancelScope(shield=True):
                await self.snap.aclose()


class Coordinator:
    """Per workspace: one snapshot or rollback at a time (CRIU seizes the whole tree, and two dumps of one tree
    collide in ``PTRACE_SEIZE``), and the fork batch still open to joiners."""

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.open: Batch | None = None


_coordinators: weakref.WeakKeyDictionary[WorkspaceCore, Coordinator] = weakref.WeakKeyDictionary()


def coordinator(ws: WorkspaceCore) -> Coordinator:
    coord = _coordinators.get(ws)
    if coord is None:
        coord = _coordinators[ws] = Coordinator()
    return coord
