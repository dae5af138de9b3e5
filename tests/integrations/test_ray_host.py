"""The Ray host actor's own logic, in this process (no cluster): what a workspace's contents can make it wait for."""

from __future__ import annotations

import errno
import threading

import anyio
import pytest

from bunshin_async import HostCallError, Limits, TransferError
from bunshin_async._workspace._core import WorkspaceCore
from bunshin_async.integrations._ray import _fetches, _host
from bunshin_async.integrations._ray._holdings import Holdings
from bunshin_async.integrations._ray._host import WorkspaceHost
from bunshin_async.integrations._ray._placement import Ledger, room
from bunshin_async.integrations.ray import HostConfig


async def test_info_never_waits_for_a_memory_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """``info`` is on every placement's path (every E2B create); measuring what the host holds walks every
    workspace's files, which a sandbox of many files makes slow (2-3 s for 200k empty files here). A walk that does
    not end (injected) must not hold ``info`` up: it answers with the last reading, one walk at a time."""
    gate = threading.Event()
    walks: list[int] = []

    def walk(held: object, dirs: object) -> int:
        walks.append(1)
        if len(walks) > 1:
            gate.wait(10)
        return 100 * len(walks)

    monkeypatch.setattr(_host, "held_memory", walk)
    monkeypatch.setattr(_host, "node_id", lambda: "node")
    host = WorkspaceHost("t", HostConfig(max_workspaces=1))
    try:
        assert (await host.info()).memory_bytes == 100  # the first reading is waited for
        with anyio.fail_after(5):
            assert (await host.info()).memory_bytes == 100
            while len(walks) < 2:  # the refresh it started is in its walk, blocked
                await anyio.sleep(0.01)
            assert [(await host.info()).memory_bytes for _ in range(3)] == [100, 100, 100]
        assert len(walks) == 2  # one walk at a time
        gate.set()
        with anyio.fail_after(10):
            while (await host.info()).memory_bytes == 100:
                await anyio.sleep(0.01)
    finally:
        gate.set()
        assert await host.shutdown() == []


@pytest.fixture
def failing_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A workspace's teardown that does its work, then fails (a cgroup or mount that stays busy): injected."""
    real = WorkspaceCore.teardown

    async def teardown(self: WorkspaceCore) -> None:
        await real(self)
        raise OSError(errno.EBUSY, "injected: busy")

    monkeypatch.setattr(WorkspaceCore, "teardown", teardown)
    monkeypatch.setattr(_host, "node_id", lambda: "node")


async def test_a_failed_close_frees_its_slot(failing_teardown: None) -> None:
    host = WorkspaceHost("t", HostConfig(max_workspaces=1))
    try:
        for _ in range(2):  # the second create gets the slot the failed close gave back
            reply = await host.create("owner", None, None, {})
            assert reply.error is None
            ws_id, *_ = reply.value
            failed = (await host.close(ws_id)).error  # not a dead host: an error of that call
            assert isinstance(failed, HostCallError) and failed.error == "OSError", failed
            assert host.held.limiter.in_use == 0 and not host.held.workspaces
    finally:
        await host.shutdown()


async def test_the_reaper_survives_a_failed_close(failing_teardown: None) -> None:
    """Owners whose lease ran out are all freed, and later ones too, though closing their workspaces fails."""
    host = WorkspaceHost("t", HostConfig(max_workspaces=3, lease_seconds=0.2))
    try:
        for owner in ("a", "b"):
            assert (await host.create(owner, None, None, {})).error is None
        with anyio.fail_after(30):
            while host.held.workspaces or host.held.limiter.in_use:  # taken out, then closed, then the slot freed
                await anyio.sleep(0.05)
        assert (await host.create("c", None, None, {})).error is None  # a later owner's lease runs out too
        with anyio.fail_after(30):
            while host.held.workspaces or host.held.limiter.in_use:  # taken out, then closed, then the slot freed
                await anyio.sleep(0.05)
    finally:
        await host.shutdown()


async def test_shutdown_closes_every_workspace_though_one_close_fails(failing_teardown: None) -> None:
    host = WorkspaceHost("t", HostConfig(max_workspaces=2))
    for owner in ("a", "b"):
        assert (await host.create(owner, None, None, {})).error is None
    assert await host.shutdown() == []
    assert host.held.limiter.in_use == 0 and not host.held.workspaces


async def test_a_fetch_lock_goes_when_no_one_holds_or_waits_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host fetches a snapshot per source snapshot at a time, under a lock per key: the lock is there while a
    fetch holds or waits on it (a waiter cancelled too), then gone, whatever the fetch did (injected: an import
    that waits for the test, then fails)."""
    gate = anyio.Event()
    imports: list[str] = []

    async def import_snapshot(frames: object) -> None:
        imports.append("in")
        await gate.wait()
        raise TransferError("injected: cut", snapshot_id="s")

    monkeypatch.setattr(_fetches, "import_snapshot", import_snapshot)
    monkeypatch.setattr(_fetches, "pull", lambda *args: None)
    fetches = _fetches.Fetches(Holdings("t", 1, 30.0), lambda snap_id: pytest.fail(snap_id))
    failed: list[str] = []

    async def fetch(source: str, snap_id: str) -> None:
        with pytest.raises(TransferError):
            await fetches.fetch(None, source, snap_id, "owner")
        failed.append(f"{source}/{snap_id}")

    async with anyio.create_task_group() as tg:
        for source, snap_id in (("a", "s1"), ("a", "s1"), ("b", "s2")):
            tg.start_soon(fetch, source, snap_id)
        waiter = anyio.CancelScope()

        async def waiting() -> None:  # a third fetch of a/s1, cancelled while it waits
            with waiter:
                await fetches.fetch(None, "a", "s1", "owner")

        tg.start_soon(waiting)
        with anyio.fail_after(5):
            while len(imports) < 2 or fetches.locks.users("a/s1") < 3:
                await anyio.sleep(0.01)
        assert len(fetches.locks) == 2 and imports == ["in", "in"]  # one import per key at a time
        waiter.cancel()
        gate.set()
    assert sorted(failed) == ["a/s1", "a/s1", "b/s2"] and len(imports) == 3
    assert len(fetches.locks) == 0


async def test_a_hosts_info_lists_the_claims_it_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's reservation (``Ledger``) and its host's count of the same workspace never add up: from the moment
    the host counts a create's slot (waiting, then in use) its info lists the create's claim, until the workspace
    closes; a create that fails lists none. A create answers with the workspace's limits."""
    monkeypatch.setattr(_host, "node_id", lambda: "node")
    host = WorkspaceHost("t", HostConfig(max_workspaces=2))
    ledger = Ledger()
    try:
        claim = ledger.reserve("t")
        info = await host.info()
        assert (info.claims, room(info, ledger.pending([info]))) == ((), 1)  # counted by the client
        reply = await host.create("owner", None, None, {}, None, None, claim)
        ws_id, _, limits = reply.value
        assert limits == Limits()  # what the host made it with (get_info of a remote sandbox reports it)
        info = await host.info()  # made, and the client has not taken the reply yet: counted once, by the host
        assert (info.in_use, info.claims, room(info, ledger.pending([info]))) == (1, (claim,), 1)
        ledger.release(claim)
        assert room(info, ledger.pending([info])) == 1
        assert (await host.close(ws_id)).error is None
        assert (await host.info()).claims == ()
        failed = ledger.reserve("t")
        assert (await host.create("owner", "no-such-image:1", None, {}, None, None, failed)).error is not None
        info = await host.info()
        assert (info.in_use, info.claims) == (0, ())
    finally:
        await host.shutdown()
