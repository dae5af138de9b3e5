"""Session-wide set-up: every test run gets its own workspace dir, snapshot dir and cgroup parent, so leak checks
see only what this run made (other runs may share the machine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

_RUNDIR = tempfile.mkdtemp(prefix="bunshin-test-")
_SNAPDIR = tempfile.mkdtemp(prefix="bunshin-snap-test-", dir="/dev/shm")
os.environ["BUNSHIN_RUNDIR"] = _RUNDIR
os.environ["BUNSHIN_SNAPDIR"] = _SNAPDIR
os.environ["BUNSHIN_CGROUP_PARENT"] = f"bunshin-test-{os.getpid()}"

import pytest  # noqa: E402

from bunshin_async._fork._layers import prepare_snapshot_store  # noqa: E402
from tests._leaks import children, leftovers  # noqa: E402

prepare_snapshot_store()  # as `bunshin snapstore` does for the default one: a tmpfs with large folios


@pytest.fixture(autouse=True)
async def no_leaks(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """After every test: no workspace process, mount, cgroup, directory, snapshot or child process of this run
    that the test started is left (session fixtures such as a Redis server started before it are fine)."""
    before = children()
    yield
    left = await leftovers(ignore_children=before)
    assert not left, f"left behind: {left}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from bunshin_async._kernel import CGROUP_ROOT, parent_name

    for ctrl_dir in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()]:
        parent = ctrl_dir / parent_name()
        if parent.is_dir():
            try:
                parent.rmdir()
            except OSError:
                pass
    shutil.rmtree(_RUNDIR, ignore_errors=True)
    subprocess.run(["umount", "--lazy", _SNAPDIR], check=False)
    shutil.rmtree(_SNAPDIR, ignore_errors=True)
