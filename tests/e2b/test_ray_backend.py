"""The Ray backend's own bookkeeping of a fork placed on several hosts, in this process (no cluster, no host actor):
the hosts' work is injected by subclassing the backend at its placement steps, to fail one host after another
made its copies."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from bunshin_async._e2b._ray import RayBackend, RemoteHandle
from bunshin_async.integrations.ray import HostRef, RayCluster, RemoteWorkspace


def _parent() -> RemoteHandle:
    return RemoteHandle(RemoteWorkspace(HostRef(None, "a", "node-a"), "parent", "owner", "criu"))


class _Copy:
    """A copy a host made (what ``RemoteHandle`` is to the backend): remembers being closed."""

    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class _Snap:
    async def aclose(self) -> None:
        pass


class _TwoHosts(RayBackend):
    """A fork whose live copies do not fit beside the parent: one copy on host a, which makes it, one on host b,
    which then fails with ``fault`` (None: it never answers)."""

    def __init__(self, fault: BaseException | None) -> None:
        super().__init__(RayCluster([HostRef(None, "a", "node-a"), HostRef(None, "b", "node-b")]))
        self._cluster = self._given
        self.fault = fault
        self.made: list[_Copy] = []
        self.a_done = anyio.Event()

    async def _beside(self, ws: Any, n: int) -> str | None:
        return None

    async def snapshot(self, ws: Any) -> Any:
        return _Snap()

    async def _place(self, snap: Any, n: int, lifetime: float) -> dict[str, tuple[int, str]]:
        return {h: (1, self.cluster.ledger.reserve(h)) for h in ("a", "b")}

    async def _copies(self, snap: Any, host: str, k: int, claim: str) -> list[Any]:
        self.cluster.ledger.release(claim)
        if host == "a":
            self.made.append(_Copy())
            self.a_done.set()
            return list(self.made)
        await self.a_done.wait()
        if self.fault is None:
            await anyio.sleep_forever()
        raise self.fault


async def test_a_fork_failing_on_one_host_closes_the_copies_another_made() -> None:
    backend = _TwoHosts(RuntimeError("not a BunshinError"))
    with pytest.raises(Exception) as info:  # noqa: PT011 - the host's error, in the task group's group
        await backend.fork(_parent(), 2, 60.0)
    assert info.group_contains(RuntimeError, match="not a BunshinError")
    assert [c.closed for c in backend.made] == [True]
    assert len(backend.cluster.ledger) == 0


async def test_a_fork_cancelled_after_one_host_made_its_copies_closes_them() -> None:
    backend = _TwoHosts(None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.fork, _parent(), 2, 60.0)
        await backend.a_done.wait()
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert [c.closed for c in backend.made] == [True]
    assert len(backend.cluster.ledger) == 0
