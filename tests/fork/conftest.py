"""Fork tests run real workspaces and real CRIU (the README's test command builds it). The root conftest checks
that no snapshot or child process (a restored pid 1 is our own child) is left after each test. Every test runs once
per restore mode (``fork_mode``): ``criu-cow`` (the CoW-restore patch, which the README's set-up builds) and the
fallback ``criu-ksm`` (stock CRIU restore into KSM-mergeable tasks, so the stock restore path is covered too), so that
neither rots. A test about one mode says so with ``@pytest.mark.fork_modes("criu-cow")``; plain stock ``"criu"`` and
``"fs"`` (filesystem-only forks, ``BUNSHIN_FORK_MODE=fs``) are run where asked for. KSM's host settings are put back
after each test that switched it on. A test marked ``tracked`` that runs in ``criu-cow`` also runs in
``criu-cow+track``: the same restore mode with ``Config.track_writes`` (criu/patches/0013), whose snapshots of a
workspace that is no CoW copy are a pre-copy plus an incremental dump (the fixture's value is then ``criu-cow``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from bunshin_async import Workspace
from bunshin_async._fork._modes import cow_available, ksm_restore
from bunshin_async._host._criu import criu_features
from bunshin_async._host._wptrack import WP_TRACK

HERE = Path(__file__).parent
TRACKED = "criu-cow+track"
"""The ``criu-cow`` restore mode with write-tracked dumps (``BUNSHIN_TRACK_WRITES=1``), for tests marked ``tracked``."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fork_mode" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("fork_modes")
        modes: tuple[str, ...] = marker.args if marker else ("criu-cow", "criu-ksm")
        if "criu-cow" in modes and metafunc.definition.get_closest_marker("tracked"):
            modes = (*modes, TRACKED)
        metafunc.parametrize("fork_mode", modes, indirect=True)


@pytest.fixture(autouse=True)
def fork_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The ``fork_mode`` restores get in this test (through ``BUNSHIN_FORK_MODE``; ``criu-cow+track`` also sets
    ``BUNSHIN_TRACK_WRITES``)."""
    mode, _, track = str(request.param).partition("+")
    if track:
        assert WP_TRACK in criu_features(), "CRIU lacks criu/patches/0013: run criu/build.sh"
        monkeypatch.setenv("BUNSHIN_TRACK_WRITES", "1")
    assert mode != "criu-cow" or cow_available(), "CRIU lacks the cow-restore patch: run criu/build.sh"
    monkeypatch.setenv("BUNSHIN_FORK_MODE", {"criu-cow": "cow", "criu": "criu", "criu-ksm": "ksm", "fs": "fs"}[mode])
    yield mode
    if mode == "criu-ksm":
        ksm_restore()


@pytest.fixture
async def ws() -> AsyncIterator[Workspace]:
    async with Workspace() as w:
        await w.write_file("/workspace/guest_state.py", (HERE / "guest_state.py").read_bytes())
        yield w


@asynccontextmanager
async def track_guest(
    monkeypatch: pytest.MonkeyPatch, *needs: tuple[str, str], log: bool = False, track: bool = False
) -> AsyncIterator[Workspace]:
    """A workspace running track_guest.py, once the host's CRIU has each of ``needs`` (a feature ``criu --version``
    lists, the patch that adds it); ``log``: CRIU logs at level 3 (what a patch says it did); ``track``: snapshots
    write-tracked (``BUNSHIN_TRACK_WRITES``), each incremental on the previous one."""
    if log:
        monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")
    if track:
        monkeypatch.setenv("BUNSHIN_TRACK_WRITES", "1")
    for feature, patch in needs:
        assert feature in criu_features(), f"CRIU lacks criu/patches/{patch}: run criu/build.sh"
    async with Workspace() as w:
        await w.write_file("/workspace/track_guest.py", (HERE / "track_guest.py").read_bytes())
        await w.spawn(["python3", "/workspace/track_guest.py"])
        yield w
