"""The Ray host actor's own logic, in this process (no cluster): what a workspace's contents can make it wait for."""

from __future__ import annotations

import threading

import anyio
import pytest

from bunshin_async.integrations._ray import _host
from bunshin_async.integrations._ray._host import WorkspaceHost
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
