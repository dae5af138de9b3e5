"""A dump's CRIU decodes the parent images' pagemaps when it answers the ready check, before the workspace is drained
and frozen, not with the tree frozen (criu/patches/0027, issue 39: a write-tracked guest's parent pagemap took
0.6-1 ms of its pause). It uses them only for the very directory its parent link opens; given another directory it
reads the parent frozen, as before. CRIU's log says which (level 3); copies are checked by digest, never by
timing."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork import _dump
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import SwrkCriu
from bunshin_async._host._wptrack import WP_TRACK

from .conftest import track_guest
from .test_track_writes import Guest, restored_digest

pytestmark = pytest.mark.fork_modes("criu-cow")

PARENT_EARLY = "parent-early"  # the feature criu/patches/0027 adds to `criu --version`


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (WP_TRACK, "0013"), (PARENT_EARLY, "0027"), log=True, track=True) as w:
        yield w


class EarlyFrom(SwrkCriu):
    """The real backend, its CRIU told to read the parent pagemaps of ``images`` before the freeze instead."""

    def __init__(self, images: Path) -> None:
        super().__init__()
        self.images = images

    async def call(self, req: Any, *, env: dict[str, str] | None = None, **kw: Any) -> Any:
        if env and "CRIU_PARENT_EARLY" in env:
            env = {**env, "CRIU_PARENT_EARLY": str(self.images)}
        return await super().call(req, env=env, **kw)


@asynccontextmanager
async def told_the_first(guest: Workspace) -> AsyncIterator[Snapshot]:
    """Three write-tracked snapshots of ``guest``, each incremental on the one before; the third's CRIU is told to
    read the first's images before the freeze (they hold pagemaps of the same processes), not its parent's. Yields
    the third once a copy of it has been checked by digest; the second's images are kept."""
    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot() as s1:
        await g.ask("write 64")
        async with await guest.snapshot() as s2:
            d3 = await g.ask("write 64")
            async with await _dump.snapshot(guest._core, EarlyFrom(record_of(s1).images)) as s3:
                assert await restored_digest(s3, g.n) == d3
                yield s3
            assert record_of(s2).images.is_dir()


def early(snap: Snapshot) -> list[str]:
    """What the dump's page dumps did with the parent pagemaps read before the freeze, one entry per process."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    return re.findall(r"parent pagemap of \d+: (read before the freeze|the parent is not the directory read)", log)


async def test_the_parent_is_read_before_the_freeze(guest: Workspace) -> None:
    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot() as s1:
        d2 = await g.ask("write 64")
        async with await guest.snapshot() as s2:
            reads = early(s2)
            assert len(reads) >= 3 and set(reads) == {"read before the freeze"}, reads  # init, agent, guest
            assert await restored_digest(s2, g.n) == d2
            # a CoW copy's dumps are incremental on the image it maps (criu/patches/0002): read early too
            [copy] = await Workspace.from_snapshot(s2)
            try:
                c = Guest(copy, g.n)
                d3 = await c.ask("write 16")
                async with await copy.snapshot() as s3:
                    assert set(early(s3)) == {"read before the freeze"}
                    assert await restored_digest(s3, c.n) == d3
            finally:
                await copy.aclose()
        assert await restored_digest(s1, g.n - 1) != d2


async def test_another_directory_is_not_used(guest: Workspace) -> None:
    async with told_the_first(guest) as s3:
        reads = early(s3)
        assert len(reads) >= 3 and set(reads) == {"the parent is not the directory read"}, reads


async def test_without_the_ready_check_the_parent_is_read_frozen(
    guest: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_dump, "OVERLAP", False)  # CRIU starts after the drain: no ready check, no early read
    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot() as s1:
        d2 = await g.ask("write 64")
        async with await guest.snapshot() as s2:
            assert early(s2) == []
            assert "parent pagemap" in (record_of(s2).images / "dump.log").read_text(errors="replace")
            assert await restored_digest(s2, g.n) == d2
        assert await restored_digest(s1, g.n - 1) != d2
