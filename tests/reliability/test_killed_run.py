"""A host test run SIGKILLed with a workspace and a snapshot open leaves its run dir (the workspace's disk, a tmpfs,
mounted in it), its snapshot store (a tmpfs on /dev/shm) and its cgroup parent: outside ``bunshin gc``'s reach. The
next run's start (``tests/_runs.reclaim_dead_runs``, from conftest's ``host_run``) removes all of it, and nothing of
a live run: this one, with a workspace running through the reclaim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from bunshin_async import Workspace
from tests._runs import claim, owner_file, reclaim_dead_runs, things_of

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("killed_run_child.py")


@pytest.mark.slow
async def test_a_killed_runs_leftovers_are_reclaimed_and_a_live_runs_kept(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    cmd = [sys.executable, "-m", "pytest", str(CHILD), "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    async with Workspace() as ws:  # this live run's workspace, running through the reclaim
        mine = things_of(os.getpid())
        child = await anyio.open_process(cmd, env={**os.environ, "KILLED_RUN_READY": str(ready)}, cwd=ROOT)
        try:
            with anyio.fail_after(180):  # a hang guard: the child's run makes a workspace and a snapshot
                while not ready.exists() and child.returncode is None:
                    await anyio.sleep(0.05)
        finally:
            child.kill()
            await child.wait()
            for stream in (child.stdout, child.stderr):
                if stream is not None:
                    await stream.aclose()
        assert ready.exists(), f"the child run ended first (rc {child.returncode})"
        assert int(ready.read_text()) == child.pid
        left = things_of(child.pid)
        kinds = {line.split()[0] for line in left}
        assert {"dir", "mount"} <= kinds, left
        assert any(f"/bunshin-test-{child.pid}-" in line and line.startswith("mount") for line in left), left
        assert any(line.endswith(f"/bunshin-test-{child.pid}") for line in left), left  # its cgroup parent

        out = await anyio.to_thread.run_sync(reclaim_dead_runs)

        assert things_of(child.pid) == set(), out
        assert things_of(os.getpid()) == mine
        assert (await ws.exec("cat /proc/self/status >/dev/null && echo alive")).stdout.strip() == "alive"


@pytest.mark.unit
def test_only_runs_proven_dead_are_reclaimed(tmp_path: Path) -> None:
    """By owner file (pid and start time) when there is one, else by the pid in the name: a recycled pid is not the
    owner; a directory not claimed yet of a live pid is kept (its run is between making and claiming it)."""
    gone = _exited_pid()
    live = os.getpid()
    tmp, shm, cgroups = (tmp_path / n for n in ("tmp", "shm", "cgroup"))
    for d in (tmp, shm, cgroups / "memory"):
        d.mkdir(parents=True)
    claimed_live = tmp / f"bunshin-test-{live}-a1"
    claimed_live.mkdir()
    claim(claimed_live)
    unclaimed_live = shm / "bunshin-snap-test-1-b2"  # pid 1 lives: not claimed yet
    unclaimed_live.mkdir()
    recycled = tmp / f"bunshin-test-{live}-c3"  # its owner had this pid before: another start time
    (recycled / "ws" / "disk").mkdir(parents=True)
    owner_file(recycled).write_text(f"{live} 1")
    unclaimed_dead = shm / f"bunshin-snap-test-{gone}-d4"
    unclaimed_dead.mkdir()
    stray = tmp / f"bunshin-test-{gone}-e5.owner"  # its run removed the directory, then died
    stray.write_text(f"{gone} 1")
    for pid in (live, 1, gone):
        (cgroups / "memory" / f"bunshin-test-{pid}" / "ws-x").mkdir(parents=True)

    out = reclaim_dead_runs([tmp, shm], cgroup_root=cgroups)

    assert sorted(p.name for p in tmp.iterdir()) == sorted([claimed_live.name, owner_file(claimed_live).name]), out
    assert [p.name for p in shm.iterdir()] == [unclaimed_live.name], out
    assert sorted(p.name for p in (cgroups / "memory").iterdir()) == [f"bunshin-test-{p}" for p in sorted((1, live))]
    assert not (cgroups / "memory" / f"bunshin-test-{gone}").exists()


@pytest.mark.unit
def test_a_run_started_after_the_listing_keeps_its_cgroup(tmp_path: Path) -> None:
    """A run that started while the reclaim removed dead runs' directories (seconds, with their mounts) has its
    cgroup parent, and no directory in the listing the reclaim took first: its pid lives, so its cgroup is kept (it
    was killed and removed: the live run's workspaces with it). A dead pid's cgroup without directories goes."""
    gone = _exited_pid()
    live = os.getpid()  # no directory of it below tmp_path: as a run whose directories came after the listing
    tmp, shm, cgroups = (tmp_path / n for n in ("tmp", "shm", "cgroup"))
    for d in (tmp, shm):
        d.mkdir()
    for pid in (live, gone):
        (cgroups / "memory" / f"bunshin-test-{pid}" / "ws-x").mkdir(parents=True)

    out = reclaim_dead_runs([tmp, shm], cgroup_root=cgroups)

    assert [p.name for p in (cgroups / "memory").iterdir()] == [f"bunshin-test-{live}"], out
    assert (cgroups / "memory" / f"bunshin-test-{live}" / "ws-x").is_dir()
    # the run of that pid, starting (it made nothing yet): its pid's cgroup parent is a dead run's of the same pid
    out = reclaim_dead_runs([tmp, shm], cgroup_root=cgroups, starting=live)
    assert list((cgroups / "memory").iterdir()) == [], out


def _exited_pid() -> int:
    """A pid no process has now (that of a child that exited and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not os.path.exists(f"/proc/{proc.pid}")
    return proc.pid
