"""Imports held at a chosen point (fault injection at the engine's and the store's interfaces), so that a test
cancels one in a known state instead of after a guessed delay."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import anyio

from bunshin_async._images._docker import AiodockerEngine
from bunshin_async._images._layers import LayerStore


class HeldExport(AiodockerEngine):
    """The real engine, whose export does not return once the archive is written (until cancelled): an import
    cancelled while it waits is cancelled during the export, whatever this machine's speed."""

    def __init__(self) -> None:
        super().__init__()
        self.exported = threading.Event()

    async def save(self, ref: str, dest: Path) -> None:
        await super().save(ref, dest)
        self.exported.set()
        await anyio.sleep_forever()


class HeldUnpack(LayerStore):
    """The real store, whose first layer's unpacking stops once it has read ``after`` bytes of the layer, until the
    import is cancelled (``unpacking`` is set then)."""

    def __init__(self, root: Path, after: int = 0) -> None:
        super().__init__(root)
        self.after = after
        self.unpacking = threading.Event()

    def add(  # type: ignore[no-untyped-def]
        self, diff_id, opener, limits, budget, cancel=None, **kwargs
    ) -> bool:
        assert cancel is not None

        @contextlib.contextmanager
        def held():  # type: ignore[no-untyped-def]
            with opener() as raw:
                yield _HeldReader(raw, self.after, self.unpacking, cancel)

        return bool(super().add(diff_id, held, limits, budget, cancel, **kwargs))


class _HeldReader:
    def __init__(self, raw: Any, after: int, reached: threading.Event, cancel: threading.Event) -> None:
        self.raw, self.left, self.reached, self.cancel = raw, after, reached, cancel

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.raw.read(n)
        self.left -= len(data)
        if self.left <= 0 and not self.reached.is_set():
            self.reached.set()
            assert self.cancel.wait(60), "the import was not cancelled"
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)
