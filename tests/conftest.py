"""Test tiers and the run's isolation.

- Unit tests (marked ``unit``): pure logic, run by ``make test-unit`` without root, CRIU or a workspace.
- Host tests (every other test, marked ``root`` here at collection): real workspaces, CRIU, images. They run in this
  run's own workspace dir, snapshot store and cgroup parent (``host_run``), so that the leak check after each test
  (``no_leaks``) sees only what this run made: other runs may share the machine.

Nothing happens at import: set-up lives in the fixtures below, so any test module can be collected anywhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from tests._leaks import children, criu_roots, leftovers
from tests._runs import CGROUP_PREFIX, RUN_PREFIX, SNAP_PREFIX, claim, owner_file, reclaim_dead_runs, things_of


def is_unit(item: pytest.Item) -> bool:
    return item.get_closest_marker("unit") is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not is_unit(item):
            item.add_marker(pytest.mark.root)


class HostRun(NamedTuple):
    """Where this run's workspaces live (``BUNSHIN_RUNDIR``, ``BUNSHIN_SNAPDIR``, ``BUNSHIN_CGROUP_PARENT``)."""

    rundir: Path
    snapdir: Path
    cgroup_parent: str


@pytest.fixture(scope="session", autouse=True)
def host_run(request: pytest.FixtureRequest) -> Iterator[HostRun | None]:
    """This run's directories and cgroup parent, in the environment from the first test to the end of the run
    (subprocesses a test starts, a server or a Ray node, inherit them). An autouse session fixture of the root
    conftest, so it is set up before any other fixture. Not made when only unit tests were selected."""
    if all(is_unit(item) for item in request.session.items):
        yield None
        return
    assert os.geteuid() == 0, "host tests need root (`make test-unit` runs the tests that do not)"
    reclaim_dead_runs(starting=os.getpid())  # what killed runs left: outside `bunshin gc`'s reach (tests/_runs.py)
    with pytest.MonkeyPatch.context() as env:
        run = HostRun(
            Path(tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-")),
            Path(tempfile.mkdtemp(prefix=f"{SNAP_PREFIX}{os.getpid()}-", dir="/dev/shm")),
            f"{CGROUP_PREFIX}{os.getpid()}",
        )
        claim(run.rundir)
        claim(run.snapdir)
        env.setenv("BUNSHIN_RUNDIR", str(run.rundir))
        env.setenv("BUNSHIN_SNAPDIR", str(run.snapdir))
        env.setenv("BUNSHIN_CGROUP_PARENT", run.cgroup_parent)
        try:
            from bunshin_async._host._snapstore import prepare_snapshot_store

            prepare_snapshot_store()  # as `bunshin snapstore` does for the default one: a tmpfs with large folios
            yield run
        finally:
            _remove(run)


def _remove(run: HostRun) -> None:
    from bunshin_async._host._kernel import CGROUP_ROOT

    for ctrl_dir in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()]:
        with contextlib.suppress(OSError):
            (ctrl_dir / run.cgroup_parent).rmdir()
    shutil.rmtree(run.rundir, ignore_errors=True)
    subprocess.run(["umount", "--lazy", str(run.snapdir)], check=False)
    shutil.rmtree(run.snapdir, ignore_errors=True)
    for path in (run.rundir, run.snapdir):  # last: a run killed before this point is proven dead by its owner files
        owner_file(path).unlink(missing_ok=True)


@pytest.fixture(autouse=True)
async def no_leaks(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """After every host test: no workspace process, mount, cgroup, directory, snapshot, CRIU mount roots in /tmp
    (``new_criu_roots``) or child process of this run that the test started is left (session fixtures such as a
    Redis server started before it are fine). After a unit test: no child process it started."""
    host = not is_unit(request.node)
    before, roots = children(), criu_roots() if host else None
    yield
    left = await leftovers(ignore_children=before, host=host, criu_roots_before=roots)
    assert not left, f"left behind: {left}"


def _ours() -> set[str]:
    """What this run could have made (``things_of``): other runs on the machine make their own, named by their pid."""
    return things_of(os.getpid())


_BEFORE: set[str] = set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _BEFORE.update(_ours())


@pytest.hookimpl(trylast=True)  # after every fixture's and conftest's clean-up
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run when it left a cgroup, mount or directory named bunshin* that was not there at its start."""
    left = sorted(_ours() - _BEFORE)
    if left:
        session.config.get_terminal_writer().line(f"\nleft behind by this test run: {left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
