"""Write tracking between dumps (``Config.track_writes``; criu/patches/0013, docs/concepts/fork-pause.md): a dump
with ``CRIU_WP_TRACK=1`` registers the workspace's private memory with a userfaultfd in asynchronous
write-protect mode and hands each task's uffd to us; while we hold them, the next dump (incremental on that
snapshot) asks the kernel which pages were written since and writes only those, so the source's pause follows
what it wrote, not what it holds. Closing the uffds unregisters everything (``fs/userfaultfd.c``,
``userfaultfd_release()``): dropping the tracking is always safe, the next dump is then whole."""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

import anyio

from .._config import Config
from . import _criu

__all__ = ["WP_TRACK", "WriteTracking", "budget", "close_all", "close_fds", "is_uffd", "tracking_wanted"]

WP_TRACK = "wp-track"
"""The feature criu/patches/0013 adds (``criu --version`` prints ``Features: wp-track``)."""

MAX_UFFDS = 512
"""Descriptors held per workspace before the tracking is started afresh (one per task per dump that found
memory to arm): a workspace with many processes or many new mappings must not exhaust this process's fds."""

_held = 0  # uffds every workspace's tracking holds in this process together (``budget``)


def budget() -> int:
    """The uffds all workspaces' tracking may hold in this process together: a quarter of its soft RLIMIT_NOFILE
    (``MAX_UFFDS`` per workspace alone would let a few dozen workspaces of many processes fill the table)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_UFFDS * 64 if soft == resource.RLIM_INFINITY else soft // 4


class WriteTracking:
    """The uffds a workspace's tasks are tracked by and the snapshot whose dump last consumed their written set
    (``parent``: the next dump may be incremental on it). Owned by the ``WorkspaceCore``; changed by the dump."""

    def __init__(self) -> None:
        self.uffds: list[int] = []
        self.parent: Path | None = None

    def adopt(self, uffds: list[int], parent: Path) -> None:
        """A dump armed ``uffds`` and consumed every written set into ``parent``."""
        global _held
        self.uffds.extend(uffds)
        _held += len(uffds)
        self.parent = parent

    def drop(self) -> None:
        """Stop tracking (idempotent): after a failed dump (it may have consumed written sets it did not keep),
        when the tasks are replaced (a rollback) or gone, or before a dump that starts a new chain."""
        close_all(self.take())

    def take(self) -> list[int]:
        """Stop tracking and hand the uffds over, for the caller to close (``close_fds``, off the event loop)."""
        global _held
        uffds, self.uffds, self.parent = self.uffds, [], None
        _held -= len(uffds)
        return uffds

    def full(self) -> bool:
        return len(self.uffds) >= MAX_UFFDS

    def room(self, more: int) -> bool:
        """Whether ``more`` uffds may be held besides these, by this workspace (``MAX_UFFDS``) and by this process
        (``budget``)."""
        return len(self.uffds) + more < MAX_UFFDS and _held + more < budget()


def close_all(fds: list[int]) -> None:
    """Close ``fds``, emptying the list as it goes (blocking: closing a uffd walks its process's mappings under
    the mmap lock, ``userfaultfd_release()``); what is left in it was not closed."""
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


async def close_fds(fds: list[int]) -> None:
    """``close_all`` in a worker thread, shielded from cancellation; every one is closed whatever happens (what the
    thread did not close is closed here)."""
    try:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(close_all, fds)
    finally:
        close_all(fds)


def is_uffd(fd: int) -> bool:
    """Whether ``fd`` is a userfaultfd (its anon inode's name): only those are held; anything else CRIU's
    notification carried is closed."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[userfaultfd]"
    except OSError:
        return False


def tracking_wanted() -> bool:
    """Whether dumps track writes: ``Config.track_writes`` and a CRIU with criu/patches/0013."""
    return Config.current().track_writes and WP_TRACK in _criu.criu_features()
