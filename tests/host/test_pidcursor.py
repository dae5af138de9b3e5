"""The pid cursor's reading of a workspace's tasks (``_pidcursor.guest_tasks``) from the host's cgroup and /proc files:
a list longer than the bound is not read further (pure logic on a file of ours: no root, no workspace)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bunshin_async._host._pidcursor import MAX_TASKS, guest_tasks

pytestmark = pytest.mark.unit


def test_a_procs_file_past_the_bound_is_not_read_further(tmp_path: Path) -> None:
    # A cgroup's procs file grows with the workspace's processes (``Limits(pids=None)`` sets no bound): past
    # MAX_TASKS pids' worth of bytes the reading stops, and the tasks are not known. (Read whole and cut, as
    # before, this file's first bytes named one process, and its tasks were read as if it held only that one.)
    procs = tmp_path / "cgroup.procs"
    procs.write_bytes(b"1\n" * (MAX_TASKS * 6 + 1))
    assert guest_tasks(str(procs), os.getpid()) is None
    procs.write_bytes(f"{os.getpid()}\n".encode())  # within the bound: read (pid 1 itself is left out)
    tasks = guest_tasks(str(procs), os.getpid())
    assert tasks is not None and os.getpid() not in tasks
