"""A file on the workspace's overlay root takes its mount from fdinfo (criu/patches/0023, docs/concepts/fork-pause.md):
CRIU's workaround for an overlayfs bug fixed in Linux 4.2 looked every mapped and open file up again by path, an
``fstatat`` per overlayfs mount of the workspace (~9 a file, ~220 a dump, with the tree frozen), because a file's
``st_dev`` on overlayfs is its layer's and never matched a mount. CRIU's log says how many files took which way;
a copy's process still holds the file it opened and maps the libraries it mapped. Log lines and answers, never
timings."""

from __future__ import annotations

import re

import pytest

from bunshin_async import Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

FDINFO = "overlayfs-fdinfo"  # the feature criu/patches/0023 adds to `criu --version`
HOLDER = "exec 3</workspace/held; exec python3 -c 'import time; time.sleep(1000)'"
# per process whose fd 3 is the held file (the holder): how many of its mappings are of libc
PROBE = 'for p in /proc/[0-9]*; do [ "$(readlink $p/fd/3)" = /workspace/held ] && grep -c libc $p/maps; done; true'


async def test_files_on_the_overlay_take_their_mount_from_fdinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")  # CRIU logs how it found the files' mounts
    assert FDINFO in criu_features(), "CRIU lacks criu/patches/0023: run criu/build.sh"
    async with Workspace() as ws:
        await ws.write_file("/workspace/held", "held open\n")
        await ws.spawn(["sh", "-c", HOLDER])
        before = await ws.exec(["sh", "-c", PROBE])
        assert int(before.stdout) > 0, before  # one holder, mapping libc
        async with await ws.snapshot() as snap:
            log = (record_of(snap).images / "dump.log").read_text(errors="replace")
            found = re.findall(r"overlayfs: (\d+) files on the mount fdinfo names, (\d+) looked up by path", log)
            [(fdinfo, looked_up)] = found
            assert int(fdinfo) >= 2 and int(looked_up) == 0  # the held file and python3's mapped files
            [copy] = await Workspace.from_snapshot(snap)
            try:
                after = await copy.exec(["sh", "-c", PROBE])
                assert after.stdout == before.stdout
            finally:
                await copy.aclose()
