"""The SDK process SIGKILLed at each stage of a snapshot, fork, rollback and cache capture (a subprocess driver
that kills itself at hooks, tests/reliability/kill_driver.py): its workspaces die with it (PR_SET_PDEATHSIG), and so
does every CRIU it started, however busy (``_criu.PARENT_ENV``); a tree it left frozen is thawed and removed, and
``bunshin gc`` leaves the host exactly as it was before the driver ran; so does the next process's first workspace
start (``_gc.reclaim``), with nobody running ``bunshin gc``."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from bunshin_async._host._kernel import CGROUP_ROOT, detach_mounts
from tests._leaks import criu_roots, new_criu_roots
from tests._runs import cgroup_roots, remove_cgroup
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

GC = [sys.executable, "-m", "bunshin_async", "gc"]
RECOVERIES = {"gc": GC, "next start": [sys.executable, "-c", NEXT_START]}


@dataclass
class KillRun:
    """The driver's own run dir, snapshot store and cgroup parent, and the CRIUs it started."""

    run: Path
    snaps: Path
    parent: str
    criu: list[int] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        dirs = {"BUNSHIN_RUNDIR": str(self.run), "BUNSHIN_SNAPDIR": str(self.snaps)}
        return {**os.environ, **dirs, "BUNSHIN_CGROUP_PARENT": self.parent}


@pytest.fixture
def kill_run(monkeypatch: pytest.MonkeyPatch) -> Iterator[KillRun]:
    """A ``KillRun``, removed whatever the test did or failed to do (its finaliser runs on a failure too): what a
    failed recovery left (workspace disks mounted in the run dir, cgroups with tasks, frozen ones) is thawed, killed,
    detached and removed here, so that the run leaves nothing behind."""
    pid = os.getpid()
    made = KillRun(
        Path(tempfile.mkdtemp(prefix=f"bunshin-kill-{pid}-")),
        Path(tempfile.mkdtemp(prefix=f"bunshin-kill-snap-{pid}-", dir="/dev/shm")),
        f"bunshin-kill-{pid}",
    )
    for key in ("BUNSHIN_RUNDIR", "BUNSHIN_SNAPDIR", "BUNSHIN_CGROUP_PARENT"):
        monkeypatch.setenv(key, made.env[key])
    try:
        yield made
    finally:
        _remove(made)


def _remove(made: KillRun) -> None:
    for pid in made.criu:  # a CRIU the driver left (the test failed on it)
        if _is_criu(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(GC, env=made.env, cwd=ROOT, capture_output=True, timeout=120, check=False)
    for hierarchy in cgroup_roots():  # what gc did not take: thawed, emptied, removed bottom-up
        top = hierarchy / made.parent
        tree = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) if top.is_dir() else []
        for cgroup in [*tree, top] if top.is_dir() else []:
            remove_cgroup(cgroup)
    for path in (made.run, made.snaps):  # the driver's SDK mounted the store on ``snaps``; workspaces' disks
        detach_mounts(path)
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    ("stage", "recovery"),
    [(stage, "gc") for stage in STAGES]
    # what leaves restored copies, frozen trees and a capture's snapshots: recovered by the next start alone
    + [
        (stage, "next start")
        for stage in ("snapshot:post-dump", "fork:criu", "fork:frozen", "fork:restored", "capture:done")
    ],
)
async def test_sdk_killed_at_stage(stage: str, recovery: str, kill_run: KillRun) -> None:
    before, before_procs, roots = host_state(), host_processes(), criu_roots()
    with anyio.fail_after(120):
        done = await anyio.run_process([sys.executable, str(DRIVER), stage], env=kill_run.env, cwd=ROOT, check=False)
    rc, out, err = done.returncode, done.stdout.decode(), done.stderr.decode()
    kill_run.criu += [int(pid) for pid in re.findall(r"^criu (\d+)$", out, re.M)]
    assert rc == -9, f"the driver did not die at {stage} (rc {rc}): {out} {err[-2000:]}"
    ready = re.search(r"^ready (\d+)$", out, re.M)
    assert ready is not None, out
    pid1 = int(ready.group(1))
    # No CRIU outlives the driver, whatever it was doing: its parent-death signal kills it (at fork:frozen it was
    # stopped with the tree frozen, and would stay so). A hang guard: a killed process exits in milliseconds.
    with anyio.move_on_after(30) as waited:
        while any(_is_criu(pid) for pid in kill_run.criu):
            await anyio.sleep(0.02)
    assert not waited.cancelled_caught, [_state(pid)[:200] for pid in kill_run.criu if _is_criu(pid)]
    # The parent workspace's pid 1 died with the SDK, unless its tree was left frozen (CRIU killed while freezing or
    # frozen): a frozen v1 task does not die of SIGKILL until the recovery thaws it. A hang guard again.
    with anyio.move_on_after(30) as waited:
        while _running(pid1) and not _frozen(pid1):
            await anyio.sleep(0.02)
    assert not waited.cancelled_caught, (_state(pid1)[:400], _freezer_states(kill_run.parent), host_processes())
    if stage == "fork:frozen":
        assert _frozen(pid1), _freezer_states(kill_run.parent)  # what the recovery has to thaw
    gc = subprocess.run(RECOVERIES[recovery], env=kill_run.env, cwd=ROOT, capture_output=True, text=True)
    assert gc.returncode == 0, gc.stderr
    if recovery == "next start":  # its warning says what it collected
        assert re.search(r"collected \d+ workspaces left by dead processes", gc.stderr), gc.stderr
        gc.stdout = gc.stderr
    with anyio.move_on_after(30):  # thawed and killed: reaped by init meanwhile
        while _running(pid1):
            await anyio.sleep(0.02)
    assert not _running(pid1), _state(pid1)[:400]
    after = host_state()
    # Only what the driver started counts: an earlier test's process is that test's leak, reported there.
    left = {pid: what for pid, what in host_processes().items() if pid not in before_procs}
    assert not left, (gc.stdout, list(left.values()))
    # no cgroup left under the parent, so no frozen one either
    assert (after.mounts, after.cgroups, after.store_bytes) == (before.mounts, before.cgroups, 0), gc.stdout
    assert not _freezer_states(kill_run.parent), gc.stdout
    assert not list(kill_run.run.iterdir()), (gc.stdout, list(kill_run.run.rglob("*"))[:10])
    assert not list(kill_run.snaps.iterdir()) if kill_run.snaps.exists() else True, gc.stdout
    assert "removed" in gc.stdout
    assert not new_criu_roots(roots)  # a restore's, killed with the SDK: on a tmpfs that went with CRIU


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


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan's reaper may be slow to reap it)."""
    return "zombie" not in _state(pid)


def _is_criu(pid: int) -> bool:
    """Whether ``pid`` is a running CRIU, or the bunshin-init it starts as (not a zombie, nor a recycled pid)."""
    return _running(pid) and _state(pid).split("\n", 1)[0] in ("Name:\tcriu", "Name:\tbunshin-init")


def _frozen(pid: int) -> bool:
    """Whether ``pid``'s v1 freezer cgroup is frozen or freezing."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        path = next(line.split(":", 2)[2] for line in lines if line.split(":")[1] == "freezer")
        state = (CGROUP_ROOT / "freezer" / path.lstrip("/") / "freezer.state").read_text().strip()
    except (OSError, StopIteration, IndexError):
        return False
    return state in ("FROZEN", "FREEZING")
