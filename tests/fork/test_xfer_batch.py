"""A dump writes the pages a page pipe buffer holds into the pages image in one splice, not one per run of pages
(criu/patches/0018, docs/concepts/fork-pause.md): a write-tracked checkpoint's written pages are scattered, mostly
runs of one page. CRIU's log counts the pages and the batches they went in; every snapshot restores to the guest's
digest (pages in the wrong order or place would change it). Counts and digests, never timings."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork._snapshot import record_of

from .conftest import track_guest
from .test_track_writes import Guest, restored_digest

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

XFER_BATCH = "xfer-batch"  # the feature criu/patches/0018 adds to `criu --version`


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (XFER_BATCH, "0018"), log=True) as w:
        yield w


def batches(snap: Snapshot) -> tuple[int, int]:
    """Pages the snapshot's dump wrote and the batches they went in, over all its processes (CRIU's log)."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    found = [(int(p), int(b)) for p, b in re.findall(r"Pages written: (\d+) in (\d+) batches", log)]
    return sum(p for p, _ in found), sum(b for _, b in found)


async def test_scattered_pages_are_written_in_few_batches(guest: Workspace) -> None:
    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot() as s1:
        d2 = await g.ask("write 256")  # one byte in each of 256 pages spread over the 16 MiB buffer
        async with await guest.snapshot() as s2:
            for snap in (s1, s2):
                pages, n = batches(snap)
                assert pages >= 256
                assert n * 8 <= pages, (pages, n)  # a splice per run would be about one per written page
            assert await restored_digest(s2, g.n) == d2
