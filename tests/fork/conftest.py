"""Fork tests run real workspaces and real CRIU (the README's test command builds it). The root conftest checks
that no snapshot or child process (a restored pid 1 is our own child) is left after each test. Every test runs once
per restore mode (``fork_mode``): ``criu-cow`` (the CoW-restore patch, which the README's set-up builds) and stock
``criu``, so that neither rots. A test about one mode says so with ``@pytest.mark.fork_modes("criu-cow")``;
``"fs"`` (filesystem-only forks, ``BUNSHIN_FORK_MODE=fs``) is only run where asked for."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bunshin_async import Workspace
from bunshin_async._fork import cow_available

HERE = Path(__file__).parent

pytestmark = pytest.mark.root


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fork_mode" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("fork_modes")
        metafunc.parametrize("fork_mode", marker.args if marker else ("criu-cow", "criu"), indirect=True)


@pytest.fixture(autouse=True)
def fork_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The ``fork_mode`` restores get in this test (through ``BUNSHIN_FORK_MODE``)."""
    mode: str = request.param
    assert mode != "criu-cow" or cow_available(), "CRIU lacks the cow-restore patch: run criu/build.sh"
    monkeypatch.setenv("BUNSHIN_FORK_MODE", {"criu-cow": "cow", "criu": "criu", "fs": "fs"}[mode])
    return mode


@pytest.fixture
async def ws() -> AsyncIterator[Workspace]:
    async with Workspace() as w:
        await w.write_file("/workspace/guest_state.py", (HERE / "guest_state.py").read_bytes())
        yield w
