"""Fork tests run real workspaces and real CRIU. Each run keeps its snapshots in its own tmpfs dir; after every test
no snapshot, child process (a restored pid 1 is our own child) or zombie may be left."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import psutil
import pytest

_SNAPDIR = tempfile.mkdtemp(prefix="bunshin-snap-test-", dir="/dev/shm")
os.environ["BUNSHIN_SNAPDIR"] = _SNAPDIR

from bunshin_async import Workspace  # noqa: E402
from bunshin_async._paths import criu_binary  # noqa: E402

HERE = Path(__file__).parent

pytestmark = pytest.mark.root

if os.geteuid() != 0 or criu_binary() is None:
    pytest.skip("fork tests need root and CRIU (criu/build.sh)", allow_module_level=True)


def _children() -> list[str]:
    return [f"{p.pid} {p.name()} {p.status()}" for p in psutil.Process().children(recursive=True)]


@pytest.fixture(autouse=True)
async def no_fork_leaks() -> AsyncIterator[None]:
    yield
    with anyio.move_on_after(3):
        while _children() or any(Path(_SNAPDIR).iterdir()):
            await anyio.sleep(0.02)
    assert not _children(), f"child processes left: {_children()}"
    assert not any(Path(_SNAPDIR).iterdir()), f"snapshots left: {list(Path(_SNAPDIR).iterdir())}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SNAPDIR, ignore_errors=True)


@pytest.fixture
async def ws() -> AsyncIterator[Workspace]:
    async with Workspace() as w:
        await w.write_file("/workspace/guest_state.py", (HERE / "guest_state.py").read_bytes())
        yield w
