"""Host-side kernel helpers (``bunshin_async._host._kernel``) that need no workspace."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from pathlib import Path

import pytest

from bunshin_async._host._kernel import Cgroup, CgroupView, mount_options, prime_cgroup_attach


def _cgroups() -> dict[str, str]:
    """This process's and each of its threads' cgroups."""
    out = {"self": Path("/proc/self/cgroup").read_text()}
    for task in Path("/proc/self/task").iterdir():
        out[task.name] = (task / "cgroup").read_text()
    return out


def test_prime_cgroup_attach_moves_nothing() -> None:
    gate = threading.Event()
    worker = threading.Thread(target=gate.wait)  # a second thread: cgroup.procs moves whole thread groups
    worker.start()
    try:
        before = _cgroups()
        prime_cgroup_attach()
        assert _cgroups() == before
    finally:
        gate.set()
        worker.join()


def test_mount_options_reports_the_deepest_mount(tmp_path: Path) -> None:
    from bunshin_async._native import mount  # the C extension: a host test (the unit tier runs without it)

    point = tmp_path / "m"
    point.mkdir()
    outer = mount_options(tmp_path)
    assert outer is not None and outer == mount_options(tmp_path.parent)
    mount("test", str(point), "tmpfs", 0, "size=1m,huge=within_size")
    try:
        (point / "deeper").mkdir()
        fstype, options = mount_options(point / "deeper" / "not-yet") or ("", "")
        assert fstype == "tmpfs" and "size=1024k" in options.split(",") and "huge=within_size" in options
        assert mount_options(tmp_path) == outer
    finally:
        subprocess.run(["umount", str(point)], check=True)
    assert mount_options(point) == outer


def test_a_cgroup_removed_while_read_has_no_processes(tmp_path: Path) -> None:
    # Reading cgroup.procs of a v1 cgroup removed after the open fails with ENODEV, not ENOENT: a removed cgroup,
    # whichever way the read races its removal, has no processes (the experiment's monitor samples forks that go).
    probe = Path("/sys/fs/cgroup/pids") if Path("/sys/fs/cgroup/pids").is_dir() else Path("/sys/fs/cgroup")
    d = probe / f"bunshin-enodev-{os.getpid()}"
    d.mkdir()
    f = (d / "cgroup.procs").open()
    d.rmdir()
    with pytest.raises(OSError) as err:
        f.read()
    f.close()
    assert err.value.errno == errno.ENODEV  # what the kernel does: the case pids() must take

    class Racing(type(tmp_path)):  # type: ignore[misc]
        def read_text(self, *args: object, **kwargs: object) -> str:
            raise OSError(errno.ENODEV, "No such device")

    assert Cgroup(1, [Racing(d)]).pids() == [] and Cgroup(1, [d]).pids() == []


@pytest.mark.unit
def test_a_workspace_shows_its_cgroup_read_only(tmp_path: Path) -> None:
    """``Workspace.cgroup`` is a view: the counters of the cgroup it wraps, and no way to freeze, kill or remove it;
    two views of one cgroup are equal (a rollback keeps the workspace's cgroup), of two cgroups not."""
    (tmp_path / "cgroup.procs").write_text("34\n12\n")
    cg = Cgroup(1, [tmp_path])
    view = CgroupView(cg)
    assert view.pids() == [12, 34] and view.dirs == (tmp_path,) and view.memory_usage() is None
    assert view == CgroupView(cg) and hash(view) == hash(CgroupView(cg)) and view != CgroupView(Cgroup(1, [tmp_path]))
    assert [n for n in ("freeze", "thaw", "kill_all", "destroy_sync", "create", "version") if hasattr(view, n)] == []
    with pytest.raises(AttributeError):
        view.dirs = ()  # type: ignore[misc]
