"""A dump reads its parent images' own pagemap only, not every image up the chain (criu/patches/0022,
docs/concepts/fork-pause.md): a write-tracked workspace's chain grows a level per checkpoint, and each level cost
~0.5 ms to read and free with the tree frozen, though a hole is checked against the parent's own entries. CRIU's
log (level 3) says per process how many images its page dump read; a snapshot whose chain is five deep read one,
and it and its parent restore to the guest's digests. Log lines and digests, never timings."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._snapstore import mem_chain_depth
from bunshin_async._host._wptrack import WP_TRACK

from .conftest import track_guest
from .test_track_writes import Guest, restored_digest

pytestmark = pytest.mark.fork_modes("criu-cow")

PARENT_ONLY = "parent-pagemap-only"  # the feature criu/patches/0022 adds to `criu --version`


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (WP_TRACK, "0013"), (PARENT_ONLY, "0022"), log=True, track=True) as w:
        yield w


def parent_reads(snap: Snapshot) -> list[tuple[int, int]]:
    """Per process of the snapshot's dump: (images, entries) of the parent pagemaps its page dump read."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    found = re.findall(r"Pages of \d+: .*parent pagemap \d+ us \((\d+) images, (\d+) entries\)", log)
    return [(int(i), int(e)) for i, e in found]


async def test_a_dump_reads_its_parents_pagemap_only(guest: Workspace) -> None:
    g = Guest(guest)
    await g.ask("digest")
    snaps: list[Snapshot] = []
    digests: list[str] = []
    try:
        for _ in range(4):
            digests.append(await g.ask("write 64"))  # 64 pages of the 16 MiB buffer: a hole run between each
            snaps.append(await guest.snapshot())
        last = snaps[-1]
        # the first snapshot is a pre-copy plus a dump on it, each later one a level more
        assert mem_chain_depth(record_of(last).path) == 5
        reads = parent_reads(last)
        assert len(reads) >= 3  # init, the agent, the guest (and whatever else runs): one line each
        assert {images for images, _ in reads} == {1}, reads
        # the guest's parent holds its written runs and the hole runs between them: its pagemap was read
        assert max(entries for _, entries in reads) >= 64
        assert await restored_digest(last, g.n) == digests[-1]
        assert await restored_digest(snaps[-2], g.n - 1) == digests[-2]
    finally:
        for s in snaps:
            await s.aclose()
