"""The issue-39 prototype's claims (criu/wp-track, docs/concepts/fork-pause.md), checked on this kernel: a host
process tracks a workspace process's writes exactly through PAGEMAP_SCAN on a userfaultfd it holds alone, the
kernel's limits (new VMAs and forked children are untracked), and CRIU dumps such a task while the tracking goes on,
its restored copy carrying no registration. Page counts and checksums only, never timings."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from bunshin_async._host import _paths

pytestmark = pytest.mark.fork_modes("criu")  # the tool uses CRIU directly, not a fork mode

TOOL_DIR = Path(__file__).parents[2] / "criu" / "wp-track"


@pytest.fixture(scope="module")
def wptrack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wptrack") / "wptrack"
    subprocess.run(["make", "-s", "-C", str(TOOL_DIR), f"OUT={out}"], check=True)
    return out


def run_criu(criu: Path, dump: Path, log: str, *args: str | Path) -> None:
    """``criu <args> -D dump -o log``, with a hang guard (generous: a plain dump once outlived pytest's 300 s on the
    loaded machine, and pytest's timeout showed nothing of CRIU) whose failure shows the end of CRIU's log."""
    try:
        subprocess.run([criu, *args, "-D", dump, "-o", log], check=True, timeout=150)
    except subprocess.TimeoutExpired:
        tail = (dump / log).read_text(errors="replace")[-3000:] if (dump / log).exists() else "(no log)"
        raise AssertionError(f"criu {args[0]} still ran after 150 s; the end of {log}:\n{tail}") from None


def facts(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.split() if "=" in line)


def test_host_tracks_exactly_the_written_pages(wptrack: Path) -> None:
    got = facts(subprocess.run([wptrack, "check"], check=True, capture_output=True, text=True).stdout)
    assert got == {
        "soft_dirty_works": "0",  # CONFIG_MEM_SOFT_DIRTY is off here: CRIU's --track-mem cannot work
        "seccomp_filtered_uffd": "EPERM",  # a filter denying userfaultfd, as the workspace's does
        "seccomp_suspended_uffd": "ok",  # ... bypassed once seized with PTRACE_O_SUSPEND_SECCOMP, as compel does
        "child_uffd_fds": "0",  # the task holds no userfaultfd: nothing of criu#2021 to dump
        "host_uffd_fds": "1",
        "smaps_uw": "1",
        "wpallowed_pages": "1024",
        "arm_written_pages": "1024",
        "idle_written_pages": "0",
        "wrote16_written_pages": "16",
        "rescan_written_pages": "0",  # the scan re-armed what it reported
        "wrote300x2_written_pages": "300",
        "new_vma_wpallowed_pages": "0",  # mmap after arming: untracked, so dumped whole
        "new_vma_present_pages": "8",
        "new_vma_checked_scan": "EPERM",
        "whole_space_unchecked_scan_written_pages": "0",
        "forked_child_wpallowed_pages": "0",  # no UFFD_FEATURE_EVENT_FORK: a child forked after arming is untracked
        "forked_child_smaps_uw": "0",
        "forked_child_checked_scan": "EPERM",
        "parent_after_fork_written_pages": "0",
        "dontneed_written_pages": "8",  # dropped pages count as written: a copy never keeps their old content
        "dontneed_present_pages": "0",
        "dontneed_read_written_pages": "8",
        "dontneed_read_present_pages": "8",
        "dontneed_read_pfnzero_pages": "8",
        "dontneed_rich_mask_written_pages": "8",
        "file_private_arm_written_pages": "64",  # a MAP_PRIVATE file mapping (a CoW restore's) is trackable too
        "file_private_wrote5_written_pages": "5",
        "after_close_wpallowed_pages": "0",  # the host's close unregisters everything: nothing outlives the host
        "after_close_smaps_uw": "0",
    }


def test_precopy_then_frozen_pass_copies_only_the_written_pages(wptrack: Path) -> None:
    out = subprocess.run([wptrack, "bench", "16", "1", "2"], check=True, capture_output=True, text=True).stdout
    got = facts(out.replace('"', "").replace(": ", "=").replace(",", " ").strip("{}\n"))
    assert (got["written_pages"], got["dirty_pages"], got["copies_wrong"]) == ("256", "256", "0")


def test_criu_dumps_a_tracked_task_and_its_copy_is_untracked(wptrack: Path, tmp_path: Path) -> None:
    criu = _paths.criu_binary()
    assert criu is not None
    dump = tmp_path / "dump"
    dump.mkdir()

    def inspect(target: int) -> dict[str, str]:
        run = subprocess.run([wptrack, "inspect", str(target), addr, size], capture_output=True, text=True)
        return facts(run.stdout)

    live = 0  # the tracked task (setsid, so it outlives wptrack): killed here if the test fails before CRIU kills it
    with subprocess.Popen([wptrack, "hold", "4"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as hold:
        assert hold.stdin is not None and hold.stdout is not None
        try:
            info = facts(hold.stdout.readline())
            pid, addr, size = int(info["pid"]), info["addr"], info["len"]
            live = pid
            assert info["armed"] == str(int(size) // 4096)

            def scan() -> dict[str, str]:
                assert hold.stdin is not None and hold.stdout is not None
                hold.stdin.write("scan\n")
                hold.stdin.flush()
                return facts(hold.stdout.readline())

            os.kill(pid, signal.SIGSTOP)  # a stable checksum; CRIU dumps and restores the task stopped
            scan()  # re-armed: what is written from here on is CRIU's doing
            before = inspect(pid)
            assert (before["wpallowed"], before["uw"], before["uffd_fds"]) == (str(int(size) // 4096), "1", "0")

            run_criu(criu, dump, "d1.log", "dump", "-t", str(pid), "--leave-running")
            after = scan()
            # Still tracked, and the dump (parasite and all) wrote no page of it.
            assert (after["written"], after["wpallowed"], after["uw"]) == ("0", before["wpallowed"], "1")

            run_criu(criu, dump, "d2.log", "dump", "-t", str(pid))  # kills it
            live = 0
            hold.stdin.write("quit\n")  # reaps it: its pid is free for the restore
            hold.stdin.flush()
            assert hold.wait() == 0
        finally:
            if live:
                os.kill(live, signal.SIGKILL)  # still wptrack's child, unreaped: the pid cannot be anyone else's
            hold.kill()
    run_criu(criu, dump, "r.log", "restore", "-d")
    try:
        assert inspect(pid) == {**before, "wpallowed": "0", "uw": "0"}  # the same memory, no registration
    finally:
        os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # restored with -d under init, which reaps it
