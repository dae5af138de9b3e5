"""A dump's page scan of private anonymous memory asks the kernel no ``PAGE_IS_FILE`` (criu/patches/0016,
docs/concepts/fork-pause.md): that question made the kernel look up every present page's struct page, so the scan
grew with memory. CRIU's log counts the memory scanned so; file pages are still left out wherever a scan window holds
a file mapping (a private file mapping read but never written is not dumped, also beside anonymous memory in one
window), and every copy has the guest's digest. Page counts and digests, never timings."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork._snapshot import record_of

from .conftest import track_guest
from .test_smaps_early import guest_pid
from .test_track_writes import Guest, dump_stats, restored_digest

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

PMC_ANON = "pmc-anon"  # the feature criu/patches/0016 adds to `criu --version`
BUF_KIB = 16 << 10  # track_guest.py's 16 MiB buffer
FILE_PAGES = 384  # track_guest.py's ``fmap`` file: 1.5 MiB


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (PMC_ANON, "0016"), log=True) as w:
        yield w


def anon_scanned_kib(snap: Snapshot, pid: int) -> int:
    """KiB of ``pid``'s memory the snapshot's dump scanned without ``PAGE_IS_FILE`` (CRIU's log, one line a dump)."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    found = re.findall(rf"{pid}: \d+ PAGEMAP_SCAN fills, \d+ of anonymous memory only \((\d+) KiB without", log)
    assert len(found) == 1, found
    return int(found[0])


async def test_anonymous_memory_is_scanned_without_file_lookups(guest: Workspace) -> None:
    g = Guest(guest)
    d0 = await g.ask("digest")
    pid = guest_pid(guest)
    async with await guest.snapshot() as s1:
        assert anon_scanned_kib(s1, pid) >= BUF_KIB  # the 16 MiB buffer at least (its VMA is private anonymous)
        assert await restored_digest(s1, g.n) == d0


async def test_file_pages_beside_anonymous_memory_are_not_dumped(guest: Workspace) -> None:
    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot() as s1:
        d1 = await g.ask("fmap")  # 64 KiB anonymous, then 1.5 MiB of a file read page by page, one scan window
        async with await guest.snapshot() as s2:
            # a scan that dropped PAGE_IS_FILE for the file mapping (or for the window, judged by its first VMA)
            # would dump its 384 present file pages; the guest writes a few pages of its own between the dumps
            assert dump_stats(s2)["pages_written"] < dump_stats(s1)["pages_written"] + FILE_PAGES // 2
            assert await restored_digest(s2, g.n) == d1
