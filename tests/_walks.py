"""Counting the host's walks of workspace trees (``_host._tree.walk``, the one walker the accounting uses): a reading
that must stay cheap on a tree of any size is checked by the walks it made, not by how long it took."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin_async._host import _tree


class Walks:
    """Every ``_tree.walk`` made while installed (``install``), by the root it walked."""

    def __init__(self) -> None:
        self.roots: list[Path] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Walks:
        walk = _tree.walk

        def counted(path: str | Path) -> Iterator[_tree.Entry]:
            self.roots.append(Path(path))
            return walk(path)

        monkeypatch.setattr(_tree, "walk", counted)
        return self

    def under(self, directory: Path) -> list[Path]:
        """The walks of ``directory`` or anything below it."""
        return [r for r in self.roots if r.is_relative_to(directory)]
