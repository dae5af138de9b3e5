"""Group forking for trainers that hand out rollouts one at a time (SkyRL-gym's environments, verl's agent loops).

``GroupRollout`` knows its ``n`` rollouts up front; these frameworks create one environment or agent loop per
sample and only tell which samples belong together (a group id, verl's ``uid``). ``GroupForks`` gives the first
member of a group a fresh workspace set up for the task, snapshots it, and starts every member, that one included,
as a copy of the snapshot. The snapshot is freed when the last open member of its group is released, so members
that overlap in time (as a trainer's batch does) share one set-up; a member arriving after that sets it up again.
"""

from __future__ import annotations

import anyio

from .._fork._snapshot import Snapshot
from .._host._kernel import Limits
from .._images._image import Image
from .._rollout._rollout import Task, prepare
from .._workspace._facade import Workspace


class _Group:
    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.snapshot: Snapshot | None = None
        self.members = 0
        self.setups = 0


class GroupForks:
    """Workspaces for members of groups (module doc). Every workspace handed out is tracked until ``release``;
    ``aclose()`` frees whatever is still out. One event loop at a time: use it from the loop that made it."""

    def __init__(self, *, image: Image | None = None, limits: Limits | None = None) -> None:
        self.image = image
        self.limits = limits
        self._groups: dict[str, _Group] = {}
        self._live: set[Workspace] = set()

    @property
    def live(self) -> int:
        """Workspaces handed out and not released yet."""
        return len(self._live)

    def setups(self, group_id: str) -> int:
        """How many times ``group_id``'s task was set up."""
        group = self._groups.get(group_id)
        return group.setups if group is not None else 0

    async def acquire(self, task: Task, group_id: str | None = None, *, limits: Limits | None = None) -> Workspace:
        """A workspace with ``task`` set up: a fresh one without a group, else a copy of the group's set-up.
        Nothing is left behind on failure or cancellation."""
        limits = limits or self.limits
        if group_id is None:
            ws = Workspace(self.image, limits=limits)
            await ws.start()
            try:
                await prepare(ws, task)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await ws.aclose()
                raise
            self._live.add(ws)
            return ws
        group = self._groups.setdefault(group_id, _Group())
        group.members += 1
        try:
            async with group.lock:
                if group.snapshot is None:
                    base = Workspace(self.image, limits=limits)
                    try:
                        await base.start()
                        await prepare(base, task)
                        group.snapshot = await base.snapshot()
                        group.setups += 1
                    finally:
                        with anyio.CancelScope(shield=True):
                            await base.aclose()  # every member is a copy of its snapshot
                snapshot = group.snapshot
            (ws,) = await Workspace.from_snapshot(snapshot, 1)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._leave(group_id)
            raise
        self._live.add(ws)
        return ws

    async def release(self, ws: Workspace, group_id: str | None = None) -> None:
        """Close a member's workspace and leave its group (the last member out frees the snapshot). Shielded;
        releasing twice does nothing."""
        with anyio.CancelScope(shield=True):
            if ws not in self._live:
                return
            self._live.discard(ws)
            await ws.aclose()
            if group_id is not None:
                await self._leave(group_id)

    async def _leave(self, group_id: str) -> None:
        group = self._groups.get(group_id)
        if group is None:
            return
        group.members -= 1
        if group.members <= 0:
            snapshot, group.snapshot = group.snapshot, None
            if snapshot is not None:
                await snapshot.aclose()

    async def aclose(self) -> None:
        """Close every workspace still out and every snapshot. Idempotent."""
        with anyio.CancelScope(shield=True):
            while self._live:
                await self._live.pop().aclose()
            for group in self._groups.values():
                if group.snapshot is not None:
                    await group.snapshot.aclose()
                    group.snapshot = None
                group.members = 0
