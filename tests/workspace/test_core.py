"""The workspace core's hold on its pid 1's pidfd, which its agent client and the client's pid-cursor ledger borrow
(``_workspace._core``): pure logic on a child process of ours, no workspace."""

from __future__ import annotations

import os
from typing import Any

import pytest

from bunshin_async._host._client import AgentClient
from bunshin_async._workspace._core import WorkspaceCore

pytestmark = pytest.mark.unit


def _sleeper() -> tuple[int, int]:
    pid = os.posix_spawn("/bin/sleep", ["sleep", "1000"], {})
    return pid, os.pidfd_open(pid)


async def test_a_kept_client_lets_go_of_the_pidfd_its_core_closes() -> None:
    """A restore in place (``rebase``) kills pid 1 and closes its pidfd but keeps the client
    (``stop_processes(keep_client=True)``), whose pid-cursor ledger borrows that pidfd and duplicates it for each
    reading: the ledger lets go of it first, so that until ``adopt`` hands it the new pid 1's it never duplicates a
    closed descriptor number, by then maybe another workspace's pidfd."""
    spec: Any = None
    core = WorkspaceCore(spec)
    core.pid, core.pidfd = _sleeper()
    core.client = client = AgentClient(core.pid, core.pidfd, core.id)
    try:
        await core.stop_processes(keep_client=True)
        assert core.client is client and core.pidfd is None
        assert client.pids.pidfd < 0
        assert not await client.pids._exchange(6, 7)  # nothing read or moved meanwhile
        pid, _ = pidfd = _sleeper()
        os.close(pidfd[1])
        await core.adopt(pid)
        assert client.pids.pidfd == client.pidfd == core.pidfd
    finally:
        await core.stop_processes()  # the client closed, the second sleep killed and reaped
