"""The SDK process SIGKILLed at each stage of a snapshot, fork, rollback and cache capture (a subprocess driver
that kills itself at hooks, tests/reliability/kill_driver.py): its workspaces die with it (PR_SET_PDEATHSIG), a
tree it left frozen included, and ``bunshin gc`` leaves the host exactly as it was before the driver ran; so does
the next process's first workspace start (``_gc.reclaim``), with nobody running ``bunshin gc``."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest

from bunshin_async._fork._precopy import FREEZE_TIMEOUT
from bunshin_async._host._kernel import CGROUP_ROOT
from tests.reliability.campaign import host_processes, host_state
from tests.reliability.kill_driver import STAGES

pytestmark = [pytest.mark.root, pytest.mark.slow]

DRIVER = Path(__file__).with_name("kill_driver.py")
ROOT = Path(__file__).resolve().parents[2]


NEXT_START = """
import anyio
from bunshin_async import Workspace

async def main():
    async with Workspace() as ws:
        print(ws.id, flush=True)

anyio.run(main)
"""

RECOVERIES = {
    "gc": [sys.executable, "-m", "bunshin_async", "gc"],
    "next start": [sys.executable, "-c", NEXT_START],
}


@pytest.mark.parametrize(
    ("stage", "recovery"),
    [(stage, "gc") for stage in STAGES]
    # what leaves restored copies, frozen trees and a capture's snapshots: recovered by the next start alone
    + [(stage, "next start") for stage in ("snapshot:post-dump", "fork:criu", "fork:restored", "capture:done")],
)
async def test_sdk_killed_at_stage(stage: str, recovery: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tempfile.mkdtemp(prefix=f"bunshin-kill-{os.getpid()}-")
    snaps = tempfile.mkdtemp(prefix=f"bunshin-kill-snap-{os.getpid()}-", dir="/dev/shm")
    parent = f"bunshin-kill-{os.getpid()}"
    env = {**os.environ, "BUNSHIN_RUNDIR": run, "BUNSHIN_SNAPDIR": snaps, "BUNSHIN_CGROUP_PARENT": parent}
    try:
        for key in ("BUNSHIN_RUNDIR", "BUNSHIN_SNAPDIR", "BUNSHIN_CGROUP_PARENT"):
            monkeypatch.setenv(key, env[key])
        before, before_procs = host_state(), host_processes()
        with anyio.fail_after(120):
            done = await anyio.run_process([sys.executable, str(DRIVER), stage], env=env, cwd=ROOT, check=False)
        rc, out, err = done.returncode, done.stdout.decode(), done.stderr.decode()
        assert rc == -9, f"the driver did not die at {stage} (rc {rc}): {out} {err[-2000:]}"
        pid1 = int(out.split()[1])
        # The parent workspace is cleanly gone: its pid 1 died with the SDK (none of its processes is left). A hang
        # guard, generous: a tree frozen by CRIU's dump dies once the orphaned CRIU (no parent-death signal) gave up
        # and thawed it. This waited 10 s, CRIU's FREEZE_TIMEOUT, and timed out once, loaded, at fork:criu: likely
        # a kill that landed while CRIU froze the tree, its pid 1 dying, so that CRIU waited out that timeout.
        with anyio.move_on_after(FREEZE_TIMEOUT + 50) as waited:
            while os.path.exists(f"/proc/{pid1}") and "zombie" not in _state(pid1):
                await anyio.sleep(0.02)
        assert not waited.cancelled_caught, (_state(pid1)[:400], _freezer_states(parent), host_processes())
        gc = subprocess.run(RECOVERIES[recovery], env=env, cwd=ROOT, capture_output=True, text=True)
        assert gc.returncode == 0, gc.stderr
        if recovery == "next start":  # its warning says what it collected
            assert re.search(r"collected \d+ workspaces left by dead processes", gc.stderr), gc.stderr
            gc.stdout = gc.stderr
        after = host_state()
        # Only what the driver started counts: an earlier test's process is that test's leak, reported there.
        left = {pid: what for pid, what in host_processes().items() if pid not in before_procs}
        assert not left, (gc.stdout, list(left.values()))
        assert (after.mounts, after.cgroups, after.store_bytes) == (before.mounts, before.cgroups, 0), gc.stdout
        assert not list(Path(run).iterdir()), (gc.stdout, list(Path(run).rglob("*"))[:10])
        assert not list(Path(snaps).iterdir()) if Path(snaps).exists() else True, gc.stdout
        assert "removed" in gc.stdout
    finally:
        # The driver's SDK mounted the snapshot store on ``snaps`` at first use (as it does for any empty store dir).
        subprocess.run(["umount", "--lazy", snaps], check=False, capture_output=True)
        subprocess.run(["rm", "-rf", run, snaps], check=False)
        for hierarchy in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()]:  # the driver's parent cgroup, empty by now
            with contextlib.suppress(OSError):  # gone already; or busy, which the session-end check reports
                (hierarchy / parent).rmdir()


def _freezer_states(parent: str) -> dict[str, str]:
    """The freezer state of each cgroup under ``parent`` (cgroup v1)."""
    out = {}
    for f in (CGROUP_ROOT / "freezer" / parent).glob("*/freezer.state"):
        with contextlib.suppress(OSError):
            out[f.parent.name] = f.read_text().strip()
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"
