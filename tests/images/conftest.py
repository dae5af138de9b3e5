"""Image tests: a private layer store while they run (``BUNSHIN_IMAGE_STORE``), and the test images built on the
real Docker engine once (``_build``: cached in the engine by content) and imported into that store once."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from bunshin_async import Image
from bunshin_async._images._layers import LayerStore

from . import _build

collect_ignore = ["dockerfiles"]  # the task image's own project and tests, run inside its workspaces


@pytest.fixture(scope="package", autouse=True)
def store() -> Iterator[LayerStore]:
    """The layer store of this directory's tests: ``Image.from_docker`` imports into it (``BUNSHIN_IMAGE_STORE``,
    set while they run)."""
    path = Path(tempfile.mkdtemp(prefix="bunshin-imgstore-test-"))
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("BUNSHIN_IMAGE_STORE", str(path))
            yield LayerStore(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fresh_store(tmp_path: Path) -> LayerStore:
    """An empty store of this test's own (import, gc and hostile-archive tests look at all of it)."""
    return LayerStore(tmp_path / "store")


def _imported(tag: str) -> Image:
    return anyio.run(Image.from_docker, tag)


@pytest.fixture(scope="package")
def bookworm_tag() -> str:
    return _build.bookworm()


@pytest.fixture(scope="package")
def layers_image(store: LayerStore, bookworm_tag: str) -> Image:
    return _imported(_build.build("layers", bookworm_tag))


@pytest.fixture(scope="package")
def user_image(store: LayerStore, bookworm_tag: str) -> Image:
    return _imported(_build.build("user", bookworm_tag))


@pytest.fixture(scope="package")
def swe_image(store: LayerStore, bookworm_tag: str) -> Image:
    return _imported(_build.build("swe", bookworm_tag))


@pytest.fixture(scope="package")
def trixie_image(store: LayerStore) -> Image:
    return _imported(_build.build("trixie", _build.trixie()))


@pytest.fixture(scope="package")
def nopython_image(store: LayerStore, bookworm_tag: str) -> Image:
    return _imported(_build.build("nopython", bookworm_tag))
