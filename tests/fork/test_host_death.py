"""No orphans: if the host process dies, its restored workspaces die with it (rst_sibling + restored pdeathsig)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import psutil
import pytest

from bunshin_async._host import _paths
from bunshin_async._host._kernel import CGROUP_ROOT, parent_name, unmount_disk
from bunshin_async._host._snapstore import collect_layers, layers_dir

# A host killed outright cannot put KSM's settings back, so the KSM mode is not killed here.
pytestmark = pytest.mark.fork_modes("criu-cow", "criu")

HOST = textwrap.dedent(
    """
    import anyio, sys
    from bunshin_async import Workspace

    HEAP = "import pathlib, time; x = b'x' * (8 << 20); pathlib.Path('/tmp/ready').touch(); time.sleep(3600)"

    async def main():
        ws = Workspace()
        await ws.start()
        # a heap the CoW restore maps (a copy that maps none of its images holds no snapshot directory)
        await ws.spawn(["python3", "-c", HEAP])
        while (await ws.exec("test -e /tmp/ready")).exit_code:
            await anyio.sleep(0.05)
        copies = await ws.fork(2)
        print(ws.id, ws.pid, *[f"{c.id}:{c.pid}" for c in copies], flush=True)
        await anyio.sleep(3600)

    anyio.run(main)
    """
)


async def test_restored_workspaces_die_with_the_host(fork_mode: str) -> None:
    proc = await anyio.open_process([sys.executable, "-c", HOST], stdout=subprocess.PIPE, env=dict(os.environ))
    assert proc.stdout is not None
    try:
        out = b""
        with anyio.fail_after(60):
            while not out.endswith(b"\n"):  # one line, which may come in several reads
                out += await proc.stdout.receive()
        line = out.decode().split()
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        await proc.aclose()
    ids = [line[0]] + [x.split(":")[0] for x in line[2:]]
    pids = [int(line[1])] + [int(x.split(":")[1]) for x in line[2:]]
    try:
        with anyio.fail_after(5):
            while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
                await anyio.sleep(0.02)
    finally:  # the dead host could not clean up: do it here so the leak check passes
        for ws_id in ids:
            unmount_disk(_paths.workspaces_dir() / ws_id)  # its Limits.disk tmpfs, which the host mounted
            shutil.rmtree(_paths.workspaces_dir() / ws_id, ignore_errors=True)
            for ctrl in CGROUP_ROOT.iterdir():
                d = ctrl / parent_name() / f"ws-{ws_id}"
                with anyio.fail_after(5):
                    while d.is_dir():
                        try:
                            d.rmdir()
                        except OSError:
                            await anyio.sleep(0.02)
        # `bunshin gc` removes the snapshot layer the copies stood on and the snapshot directory whose images
        # they mapped (CoW copies hold it): their users (the host) are all dead.
        base = Path(os.environ["BUNSHIN_SNAPDIR"])
        entries = list(base.iterdir()) if base.exists() else []
        snaps = [p for p in entries if not p.name.endswith(".users") and p != layers_dir()]
        gone = collect_layers()
        assert any(line.startswith("removed layer") for line in gone), gone
        if fork_mode == "criu-cow":
            assert snaps and all(f"removed snapshot {p.name}" in gone for p in snaps), (snaps, gone)
        assert not base.exists() or not list(base.iterdir())
