"""A dump learns the mount of each mapped file and of each task's exe, cwd and root from ``statx(STATX_MNT_ID)`` (one
syscall), not from ``/proc/self/fdinfo`` (six, 5-8 us quiet and ~18 us loaded per file here, with the tree frozen;
criu/patches/0029, issue 39). Both name the same mount; a copy of a process whose cwd is on another mount than the
root (``/proc/sys``) has it there, and its mapped libraries restore. CRIU's log counts the descriptors each way
(level 3); copies are checked by their answers, never by timing."""

from __future__ import annotations

import re

import pytest

from bunshin_async import Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

MNTID_STATX = "mntid-statx"  # the feature criu/patches/0029 adds to `criu --version`
CWDS = "for p in /proc/[0-9]*; do readlink $p/cwd; done"


async def test_mounts_come_from_statx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")
    assert MNTID_STATX in criu_features(), "CRIU lacks criu/patches/0029: run criu/build.sh"
    async with Workspace() as ws:
        await ws.spawn(["sh", "-c", "cd /proc/sys && exec sleep 300"])  # its cwd on the workspace's proc mount
        assert "/proc/sys" in (await ws.exec(CWDS)).stdout.split()
        async with await ws.snapshot() as snap:
            log = (record_of(snap).images / "dump.log").read_text(errors="replace")
            [(by_statx, by_fdinfo)] = re.findall(r"mnt_id: (\d+) descriptors by statx, (\d+) by fdinfo", log)
            # exe, cwd and root of init, the agent and the sleep, and their mapped files
            assert int(by_statx) >= 9 and int(by_fdinfo) == 0
            [copy] = await Workspace.from_snapshot(snap)
            try:
                assert "/proc/sys" in (await copy.exec(CWDS)).stdout.split()
                assert (await copy.exec("python3 -c 'print(6 * 7)'")).stdout == "42\n"
            finally:
                await copy.aclose()
