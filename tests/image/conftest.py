"""Image tests: a private layer store per test run (``BUNSHIN_IMAGE_STORE``), and the test images built on the
real Docker engine once (``_build``: cached in the engine by content) and imported into that store once per run."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import anyio
import pytest

from bunshin_async import Image
from bunshin_async._layers import LayerStore

from . import _build

collect_ignore = ["dockerfiles"]  # the task image's own project and tests, run inside its workspaces

_STORE = tempfile.mkdtemp(prefix="bunshin-imgstore-test-")
os.environ["BUNSHIN_IMAGE_STORE"] = _STORE

pytestmark = pytest.mark.root


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_STORE, ignore_errors=True)


@pytest.fixture(scope="session")
def store() -> LayerStore:
    return LayerStore(Path(_STORE))


@pytest.fixture
def fresh_store(tmp_path: Path) -> LayerStore:
    """An empty store of this test's own (import, gc and hostile-archive tests look at all of it)."""
    return LayerStore(tmp_path / "store")


def _imported(tag: str) -> Image:
    return anyio.run(Image.from_docker, tag)


@pytest.fixture(scope="session")
def bookworm_tag() -> str:
    return _build.bookworm()


@pytest.fixture(scope="session")
def layers_image(store: LayerStore, bookworm_tag: str) -> Image:
    return _imported(_build.build("layers", bookworm_tag))


@pytest.fixture(scope="session")
def user_image(store: LayerStore, bookworm_tag: str) -> Image:
    return _imported(_build.build("user", bookworm_tag))


@pytest.fixture(scope="session")
def swe_image(store: LayerStore, bookworm_tag: str) -> Image:
    return _imported(_build.build("swe", bookworm_tag))


@pytest.fixture(scope="session")
def trixie_image(store: LayerStore) -> Image:
    return _imported(_build.build("trixie", _build.trixie()))


@pytest.fixture(scope="session")
def nopython_image(store: LayerStore, bookworm_tag: str) -> Image:
    return _imported(_build.build("nopython", bookworm_tag))
