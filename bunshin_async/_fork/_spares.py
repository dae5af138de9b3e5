"""Warm spares: copies of a snapshot restored ahead of time and kept frozen, so that ``Workspace.from_snapshot``
hands one out in milliseconds (a thaw) instead of a CRIU restore.

    async with snap.keep_spares(2):
        [ws] = await Workspace.from_snapshot(snap)   # a thawed spare; the pool restores a new one behind it

A spare is a normal restored copy whose cgroup is frozen (v1 ``freezer.state`` FROZEN, v2 ``cgroup.freeze``) before
anyone talks to it: its agent client holds no connection, so nothing can time out while it sleeps, and it is thawed
before it is returned (so before its first request). The pool owns an anyio task that keeps ``k`` spares ready;
leaving the ``async with`` (or closing the snapshot) stops it and closes every spare not handed out.
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskGroup

from .._exceptions import ForkError, InvalidValue
from .._workspace._core import WorkspaceCore
from ._record import SnapshotRecord
from ._restore import restore_many

__all__ = ["SparePool"]

RETRY_DELAY = 1.0


class SparePool:
    """Keeps ``k`` frozen copies of ``snap`` ready for ``Workspace.from_snapshot`` (see the module doc). Make it
    with ``snap.keep_spares(k)`` and use it as ``async with``; one pool per snapshot at a time."""

    def __init__(self, snap: SnapshotRecord, k: int) -> None:
        if k < 1:
            raise InvalidValue("k must be at least 1", argument="k")
        self.snap = snap
        self.k = k
        self.error: BaseException | None = None
        """The last failure of a background restore (the pool retries after ``RETRY_DELAY`` s)."""
        self._ready: list[WorkspaceCore] = []
        self._wanted = anyio.Event()
        self._tg: TaskGroup | None = None
        self._closed = False

    @property
    def ready(self) -> int:
        """Spares restored, frozen and waiting."""
        return len(self._ready)

    async def __aenter__(self) -> SparePool:
        if self.snap.closed:
            raise ForkError(f"snapshot {self.snap.id} is closed", workspace_id=self.snap.workspace_id)
        if self.snap.spares is not None:
            raise InvalidValue(f"snapshot {self.snap.id} already keeps spares", argument="snap")
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self.snap.spares = self
        self._tg.start_soon(self._refill)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._tg is not None
        await self.aclose()
        await self._tg.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Stop refilling and close the spares not handed out (idempotent; also run by ``Snapshot.aclose``)."""
        self._closed = True
        if self.snap.spares is self:
            self.snap.spares = None
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            while self._ready:
                ws = self._ready.pop()
                _thaw(ws)  # v1: a frozen task cannot die
                await ws.aclose()

    async def wait_ready(self, n: int | None = None) -> None:
        """Wait until ``n`` (default ``k``) spares are ready."""
        while len(self._ready) < min(n or self.k, self.k):  # noqa: ASYNC110 - the refill task has no event for it
            await anyio.sleep(0.01)

    def take(self, n: int) -> list[WorkspaceCore]:
        """Up to ``n`` ready spares, thawed; the pool starts restoring their replacements."""
        out, self._ready = self._ready[:n], self._ready[n:]
        for ws in out:
            _thaw(ws)
        if out:
            self._wanted.set()
        return out

    async def _refill(self) -> None:
        while not self._closed and not self.snap.closed:
            missing = self.k - len(self._ready)
            if missing <= 0:
                await self._wanted.wait()
                self._wanted = anyio.Event()
                continue
            try:
                copies = await restore_many(self.snap, missing)
            except Exception as exc:  # a failed restore leaves nothing behind (``restore_many``)
                self.error = exc
                await anyio.sleep(RETRY_DELAY)
                continue
            for i, ws in enumerate(copies):
                try:
                    with anyio.CancelScope(shield=True):
                        assert ws.cgroup is not None
                        await ws.cgroup.freeze()
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        for c in copies[i:]:
                            _thaw(c)
                            await c.aclose()
                    raise
                if self._closed:
                    with anyio.CancelScope(shield=True):
                        _thaw(ws)
                        await ws.aclose()
                else:
                    self._ready.append(ws)


def _thaw(ws: WorkspaceCore) -> None:
    if ws.cgroup is not None:
        ws.cgroup.thaw()
