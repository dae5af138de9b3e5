"""``bunshin gc`` after a killed SDK (issue #20, item 5): it thaws and kills a workspace left frozen, detaches what
was left mounted below the run dir and inside the snapshot store (not the store itself: it stays mounted by
design), removes cgroups whose workspace directory is gone, and reports each thing it removed."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from anyio.streams.text import TextReceiveStream

from bunshin_async._config import Config
from bunshin_async._host import _paths, _snapstore
from bunshin_async._host._kernel import CGROUP_ROOT, Cgroup, Limits, owner_token, parent_name
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


async def test_a_start_collects_only_what_is_proven_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first start's collection (``_gc.reclaim``) runs beside other processes using the same run dir and store,
    so it takes only what is proven dead: a workspace whose owner is gone (its cgroup and disk too) and a snapshot
    whose users are all gone; a workspace with no owner file or an empty one (its maker was killed between the
    directory and the owner file: makers hold the run dir's lock shared meanwhile, the collection exclusively, so
    none is being made). It keeps one whose owner file is a symlink (not followed: it could name any file), a live
    owner's, a snapshot with no users yet (a dump in progress), and the users of a live snapshot's layer not made
    yet (its first restore makes it). Once per process and place: a second call does nothing."""
    run, snaps, parent = tmp_path / "run", tmp_path / "snaps", f"bunshin-reclaim-{os.getpid()}"
    monkeypatch.setenv("BUNSHIN_RUNDIR", str(run))
    monkeypatch.setenv("BUNSHIN_SNAPDIR", str(snaps))
    monkeypatch.setenv("BUNSHIN_CGROUP_PARENT", parent)
    dead = f"{2**22 + 1} 0"  # above pid_max's ceiling: never a live process
    names = ("deadbeef0101", "deadbeef0102", "deadbeef0103", "deadbeef0104", "deadbeef0105", "deadbeef0106")
    made = {name: run / name for name in names}
    for d in made.values():
        (d / "upper").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "disk", str(made["deadbeef0101"])], check=True)
    (made["deadbeef0101"] / "upper").mkdir()
    (made["deadbeef0101"] / "owner").write_text(dead)
    (tmp_path / "elsewhere").write_text(dead)
    (made["deadbeef0102"] / "owner").symlink_to(tmp_path / "elsewhere")
    (made["deadbeef0104"] / "owner").write_text(owner_token(os.getpid()))
    (made["deadbeef0105"] / "owner").write_text("")  # killed while writing it
    cgroup = Cgroup.create("ws-deadbeef0101", Limits())
    # no owner file here, but its cgroup has a task: a workspace whose disk (holding its owner file) is mounted in
    # another mount namespace, where a process sharing the run dir runs it
    elsewhere = Cgroup.create("ws-deadbeef0106", Limits())
    task = subprocess.Popen(["sleep", "600"])
    for d in elsewhere.dirs:
        (d / "cgroup.procs").write_text(str(task.pid))
    for name, users in (("snap-dead", dead), ("snap-new", None), (f"exp-{2**22 + 1}-0", dead)):
        (snaps / name / "images").mkdir(parents=True)
        if users is not None:
            (snaps / f"{name}.users").mkdir()
            (snaps / f"{name}.users" / "deadbeef0101").write_text(users)
    for name, users in (("unmade-live", owner_token(os.getpid())), ("unmade-dead", dead)):  # a layer not made yet
        (snaps / ".layers" / f"{name}.users").mkdir(parents=True)
        (snaps / ".layers" / f"{name}.users" / "snapshot-x").write_text(users)
    scope = snaps / f"exp-{2**22 + 1}-0"  # a dead run's scope directory, a tmpfs of its own (accounting_scope)
    subprocess.run(["mount", "-t", "tmpfs", "scope", str(scope)], check=True)
    (scope / "left").write_text("x")
    try:
        report = await _gc.reclaim()
        assert "removed deadbeef0101" in report and "removed snapshot snap-dead" in report, report
        assert f"unmounted {made['deadbeef0101']}" in report, report
        assert not made["deadbeef0101"].exists() and not any(d.exists() for d in cgroup.dirs)
        assert [n for n in names if made[n].exists()] == ["deadbeef0102", "deadbeef0104", "deadbeef0106"], report
        assert task.poll() is None and all(d.exists() for d in elsewhere.dirs)
        assert (snaps / "snap-new").exists() and not (snaps / "snap-dead").exists()
        unmade = snaps / ".layers"
        assert (unmade / "unmade-live.users").exists() and not (unmade / "unmade-dead.users").exists()
        assert f"unmounted {scope}" in report and not scope.exists() and not _mounted(scope), report
        assert await _gc.reclaim() == []
    finally:
        task.kill()
        task.wait()
        elsewhere.destroy_sync()
        for point in (made["deadbeef0101"], scope):
            if _mounted(point):
                subprocess.run(["umount", "-l", str(point)], check=False)
        for hierarchy in CGROUP_ROOT.iterdir():
            with contextlib.suppress(OSError):
                (hierarchy / parent / "ws-deadbeef0101").rmdir()
            with contextlib.suppress(OSError):
                (hierarchy / parent).rmdir()


DRIVER = Path(__file__).with_name("gc_driver.py")


def _waits_for_flock(pid: int) -> bool:
    """Whether ``pid`` is blocked on a flock(2) (a ``->`` line of /proc/locks names the waiter)."""
    with open("/proc/locks") as f:
        return any(p[1:3] == ["->", "FLOCK"] and p[5] == str(pid) for p in (line.split() for line in f) if len(p) > 5)


async def test_gc_run_by_hand_beside_a_dump_keeps_what_the_dump_makes() -> None:
    """``bunshin gc`` run while another process starts a workspace and takes a snapshot (real CRIU, ``gc_driver.py``
    stopped at each point): started while the workspace's directory exists without its owner file, or the
    snapshot's without its users, gc waits for the run dir's or the store's lock until they are written, then keeps
    them; run during CRIU's dump and once the snapshot is stored (its layer's users written, the layer not yet
    made), it keeps the snapshot and its layer's users. The driver then restores from it twice, closing each copy:
    the second restore needs the layer the snapshot still holds."""
    layers = _snapstore.layers_dir()

    async def gc() -> str:
        done = await anyio.run_process([sys.executable, "-m", "bunshin_async", "gc"], check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.decode()

    async with await anyio.open_process([sys.executable, str(DRIVER)], stderr=None) as driver:
        assert driver.stdin is not None and driver.stdout is not None
        lines = TextReceiveStream(driver.stdout)
        buffered = ""

        async def stopped(point: str) -> str:
            nonlocal buffered
            with anyio.fail_after(120):
                while "\n" not in buffered:
                    buffered += await lines.receive()
            line, buffered = buffered.split("\n", 1)
            assert line.split()[0] == point, line
            return line.split()[1]

        cli = [sys.executable, "-m", "bunshin_async", "gc"]

        async def waits(point: str, kept: str) -> None:
            """gc run now reaches a lock the driver holds, waits for it, and once the driver goes on keeps ``kept``
            (a line of its report)."""
            async with await anyio.open_process(cli, stderr=None) as waiting:
                assert waiting.stdout is not None
                with anyio.fail_after(120):  # gc reaches the lock the driver's section holds
                    while not _waits_for_flock(waiting.pid):
                        await anyio.sleep(0.01)
                assert waiting.returncode is None
                await driver.stdin.send(b"go\n")
                report = ""
                with anyio.fail_after(120):
                    async for chunk in TextReceiveStream(waiting.stdout):
                        report += chunk
                assert await waiting.wait() == 0
            assert kept in report, (point, report)

        ws_id = await stopped("workspace")
        assert not (_paths.workspaces_dir() / ws_id / "owner").exists()
        await waits("workspace", f"kept {ws_id} (owner {driver.pid} is alive)")
        snap_id = await stopped("section")
        assert (snapshot_dir() / snap_id).is_dir() and not (snapshot_dir() / f"{snap_id}.users").exists()
        await waits("section", f"kept snapshot {snap_id} (1 live users)")
        assert await stopped("post-dump") == snap_id
        report = await gc()
        assert f"kept snapshot {snap_id} (1 live users)" in report, report
        assert (layers / f"{snap_id}.users").is_dir() and not (layers / snap_id).exists()
        await driver.stdin.send(b"go\n")
        assert await stopped("stored") == snap_id
        report = await gc()
        assert f"kept snapshot {snap_id} (1 live users)" in report and (layers / f"{snap_id}.users").is_dir(), report
        await driver.stdin.send(b"go\n")
        with anyio.fail_after(120):
            while "done" not in buffered:
                buffered += await lines.receive()
        assert await driver.wait() == 0
