"""A dump does not look a mapping without a file (device 0:0, inode 0 in ``/proc/PID/maps``) up in
``/proc/PID/map_files``, where it has no link (criu/patches/0033, issue 39: an ``fstatat`` and an ``openat`` through
procfs each, with the tree frozen). A guest holding private and shared anonymous memory, an unreadable reservation
and a private file mapping, side by side, is copied with each: the log counts exactly its mappings without a file,
and the copy reads what the guest wrote. Never by timing."""

from __future__ import annotations

import re

import pytest

from bunshin_async import Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

ANON_NO_MAPFILE = "anon-no-mapfile"  # the feature criu/patches/0033 adds to `criu --version`

GUEST = r"""
import mmap, os, signal
data = open("/workspace/data", "r+b")
priv = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE)          # 00:00 0
shared = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)         # /dev/zero (deleted): a shmem file
hole = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE, prot=0)  # 00:00 0, unreadable
filed = mmap.mmap(data.fileno(), 4096, flags=mmap.MAP_PRIVATE)
priv[:5] = b"priv!"; shared[:7] = b"shared!"; filed[:6] = b"filed!"

def show(signo, frame):
    with open("/workspace/out.tmp", "wb") as f:
        f.write(priv[:5] + shared[:7] + filed[:6])
    os.replace("/workspace/out.tmp", "/workspace/out")

signal.signal(signal.SIGUSR1, show)
open("/workspace/ready", "w").close()
while True:
    signal.pause()
"""


def _no_file(maps: str) -> int:
    """The mappings of a ``/proc/PID/maps`` text with device 0:0 and inode 0."""
    return sum(1 for line in maps.splitlines() if re.match(r"\S+ \S+ \S+ 00:00 0\b", line))


async def test_mappings_without_a_file_are_not_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")
    assert ANON_NO_MAPFILE in criu_features(), "CRIU lacks criu/patches/0033: run criu/build.sh"
    async with Workspace() as ws:
        await ws.write_file("/workspace/data", b"\0" * 4096)
        await ws.write_file("/workspace/guest.py", GUEST)
        await ws.spawn(["python3", "/workspace/guest.py"])
        await ws.exec("while [ ! -e /workspace/ready ]; do sleep 0.01; done")
        pid = (await ws.exec("pgrep -f guest.py")).stdout.split()[0]
        maps = (await ws.exec(f"cat /proc/{pid}/maps")).stdout
        assert "/dev/zero (deleted)" in maps and _no_file(maps) >= 3
        async with await ws.snapshot() as snap:
            log = (record_of(snap).images / "dump.log").read_text(errors="replace")
            lines = re.findall(r"map_files: (\d+) of (\d+) mappings without a file", log)
            # one line per process (init, the agent, the guest): the guest's counts the most mappings
            skipped, _ = max(((int(a), int(b)) for a, b in lines), key=lambda c: c[1])
            assert len(lines) == 3 and skipped == _no_file(maps), (lines, _no_file(maps))
            [copy] = await Workspace.from_snapshot(snap)
            try:
                shown = f"kill -USR1 {pid}; while [ ! -e /workspace/out ]; do sleep 0.01; done; cat /workspace/out"
                assert (await copy.exec(shown)).stdout == "priv!shared!filed!"
            finally:
                await copy.aclose()
