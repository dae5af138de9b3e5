"""The pid cursor's reading of a workspace's tasks (``_pidcursor.guest_tasks``) from the host's cgroup and /proc files:
a list longer than the bound is not read further (pure logic on a file of ours: no root, no workspace); its helper
(``exchange_last_pid``) reads a pid namespace's cursor whatever the host's standard descriptors (root)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin_async._host import _pidcursor
from bunshin_async._host._pidcursor import MAX_TASKS, PidLedger, guest_tasks


@pytest.mark.unit
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


@pytest.mark.unit
async def test_the_ledger_reads_pid_1_through_its_pidfd_until_the_client_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cursor is read and moved on the client's pidfd of pid 1, never on a pid opened again by number (which may
    be another process's by now): the helper gets a duplicate made while the client holds the pidfd, closed after
    it; once the client closes (before its owner closes the pidfd), nothing is read or moved."""
    seen: list[tuple[int, int]] = []

    def exchange(pid: int, pidfd: int, expect: int | None = None, new: int | None = None) -> tuple[int, bool]:
        seen.append((pid, os.fstat(pidfd).st_ino))
        return 7, True

    monkeypatch.setattr(_pidcursor, "exchange_last_pid", exchange)
    r, w = os.pipe()  # stands for the pidfd
    try:
        ledger = PidLedger(123, r)
        fds = sorted(os.listdir("/proc/self/fd"))
        assert await ledger._exchange(6, 7)
        assert seen == [(123, os.fstat(r).st_ino)]  # the pidfd's file, whatever its number
        assert sorted(os.listdir("/proc/self/fd")) == fds  # the duplicate closed
        ledger.close()
        assert not await ledger._exchange(6, 7) and await ledger._reading("procs") == (None, None)
        assert len(seen) == 1
    finally:
        os.close(r)
        os.close(w)


HELPER = """
import os, sys
from bunshin_async._host._pidcursor import exchange_last_pid
pid, pidfd, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
for fd in sys.argv[4:]:
    os.close(int(fd))
value, _ = exchange_last_pid(pid, pidfd)
with open(out, "w") as f:
    f.write(str(value))
"""


@pytest.fixture
def namespace() -> Iterator[int]:
    """The host pid of pid 1 of a new pid namespace (a sleep), which has handed out pids 1 and 2."""
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sh", "-c", "/bin/true; exec sleep 1000"])
    try:
        path = Path(f"/proc/{outer.pid}/task/{outer.pid}/children")
        deadline = time.monotonic() + 30
        while not path.read_text().split() and time.monotonic() < deadline:  # its child: forked, not yet seen
            time.sleep(0.005)
        yield int(path.read_text().split()[0])
    finally:
        outer.kill()
        outer.wait()


@pytest.mark.root
@pytest.mark.parametrize("closed", [(), (0,), (1,), (0, 1), (0, 1, 2)], ids=str)
def test_the_helper_needs_no_standard_descriptor_of_ours(
    namespace: int, closed: tuple[int, ...], tmp_path: Path
) -> None:
    """The posix_spawn helper's file actions dup2 onto 0, 1 and HELPER_FD: with the host's 0 or 1 closed (a daemon),
    the pidfd the helper gets took one of them and was overwritten by the dup2 before its own (the helper then
    joined no namespace and the cursor was not known). The answer is the same with any of them closed."""
    pidfd = os.pidfd_open(namespace)
    try:
        args = [sys.executable, "-c", HELPER, str(namespace), str(pidfd), str(tmp_path / "out"), *map(str, closed)]
        r = subprocess.run(args, pass_fds=(pidfd,), capture_output=True, text=True, timeout=60)
    finally:
        os.close(pidfd)
    assert r.returncode == 0, r.stderr
    # sh is 1 (sleep its exec), /bin/true was 2; the helper's reading child takes a pid with set_tid, not the cursor
    assert (tmp_path / "out").read_text() == "2"
