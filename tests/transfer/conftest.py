"""Transfer tests: real workspaces and CRIU on one host, imported into a second host of their own (``Home``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.transfer._homes import Home


@pytest.fixture
def other() -> Iterator[Home]:
    home = Home("b")
    try:
        yield home
        assert not home.leftovers(), f"left behind on the other host: {home.leftovers()}"
    finally:
        home.remove()
