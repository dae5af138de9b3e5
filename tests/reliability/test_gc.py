"""``bunshin gc`` after a killed SDK (issue #20, item 5): it thaws and kills a workspace left frozen, detaches what
was left mounted below the run dir and inside the snapshot store (not the store itself: it stays mounted by
design), removes cgroups whose workspace directory is gone, and reports each thing it removed."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bunshin_async._config import Config
from bunshin_async._host import _paths
from bunshin_async._host._kernel import CGROUP_ROOT, Cgroup, Limits, parent_name
from bunshin_async._host._snapstore import snapshot_dir
from bunshin_async._workspace import _gc

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def test_gc_unmounts_thaws_and_reports() -> None:
    dead = "0 0"  # no process has pid 0: an owner that is gone
    run = _paths.workspaces_dir()
    ws_dir = run / "deadbeef0001"
    (ws_dir / "root").mkdir(parents=True)
    (ws_dir / "owner").write_text(dead)
    subprocess.run(["mount", "-t", "tmpfs", "leftover", str(ws_dir / "root")], check=True)
    snap = snapshot_dir() / "deadbeef0002"
    (snap / "images").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "leftover", str(snap / "images")], check=True)
    # A workspace cgroup left frozen with a process in it, and one whose directory is gone.
    frozen = Cgroup.create("ws-deadbeef0001", Limits())
    sleeper = subprocess.Popen(["sleep", "1000"])
    for procs in frozen.procs_files:
        Path(procs).write_text(str(sleeper.pid))
    freezer = CGROUP_ROOT / "freezer" / parent_name() / "ws-deadbeef0001" / "freezer.state"
    freezer.write_text("FROZEN")
    orphan = Cgroup.create("ws-deadbeef0003", Limits())
    try:
        report = _gc.collect()
        assert sleeper.wait(timeout=10) == -9, "the frozen workspace's process is thawed and killed"
        assert f"unmounted {ws_dir / 'root'}" in report and f"unmounted {snap / 'images'}" in report, report
        assert "removed deadbeef0001" in report and "removed cgroup ws-deadbeef0003" in report, report
        assert "removed snapshot deadbeef0002" in report, report
        assert not _mounted(ws_dir / "root") and not _mounted(snap / "images")
        assert not ws_dir.exists() and not snap.exists()
        assert not frozen.pids() and not any(d.exists() for d in [*frozen.dirs, *orphan.dirs])
        assert os.path.ismount(snapshot_dir()), "the snapshot store itself stays mounted"
        cli = subprocess.run([sys.executable, "-m", "bunshin_async", "gc"], capture_output=True, text=True)
        assert cli.returncode == 0 and "removed" not in cli.stdout, cli.stdout  # nothing left to remove
    finally:
        sleeper.kill()
        sleeper.wait()
        for p in (ws_dir / "root", snap / "images"):
            if _mounted(p):
                subprocess.run(["umount", "-l", str(p)], check=False)


def test_gc_finds_workspaces_in_the_run_scope_of_a_dead_process_and_removes_the_scope() -> None:
    """A process killed inside ``accounting_scope`` leaves a workspace cgroup one level down, under its scope
    (``<label>-<pid>-<n>``): gc removes the workspace's cgroup and then the empty scope; a live process's scope
    stays."""
    dead_pid = 2**22 + 1  # above pid_max's ceiling: never a live process
    dead, live = f"{parent_name()}/exp-{dead_pid}-0", f"{parent_name()}/exp-{os.getpid()}-0"
    Cgroup.make_parent(dead)
    Cgroup.make_parent(live)

    with Config.scoped(cgroup_parent=dead):
        orphan = Cgroup.create("ws-deadbeef0004", Limits())
    try:
        report = _gc.collect()
        assert "removed cgroup ws-deadbeef0004" in report and f"removed cgroup scope exp-{dead_pid}-0" in report
        assert not any(d.exists() for d in orphan.dirs)
        assert not (CGROUP_ROOT / "memory" / dead).exists() and (CGROUP_ROOT / "memory" / live).exists()
    finally:
        for name in (dead, live):
            for hierarchy in CGROUP_ROOT.iterdir():
                with contextlib.suppress(OSError):
                    (hierarchy / name / "ws-deadbeef0004").rmdir()
                with contextlib.suppress(OSError):
                    (hierarchy / name).rmdir()
