"""A write-tracked VMA's dump walks its page tables once (criu/patches/0036, issue 39): on a parent that is a dump,
the written-set scan also gives each written run's categories and an unwritten run is a hole where the parent's
pagemap holds it; a dump on a pre-copy (whose pagemap lists the armed holes' markers as pages of zeros) keeps the
two walks. Dropped pages (``MADV_DONTNEED``, written before or not) restore as zeros, never as the parent's old
content, and a dropped page read again (the zero page) too. What CRIU's log (level 3) says and digests, never
timings."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork._snapshot import record_of

from .conftest import track_guest
from .test_track_writes import BUF_PAGES, Guest, dump_stats, precopy_of, restored_digest

pytestmark = [pytest.mark.fork_modes("criu-cow")]

WP_ONE_WALK = "wp-one-walk"  # the feature criu/patches/0036 adds to `criu --version`
ONE_WALK = "Pagemap generated (tracked, one walk)"
TWO_WALKS = "Pagemap generated (tracked):"


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (WP_ONE_WALK, "0036"), log=True, track=True) as w:
        yield w


def walks(snap: Snapshot) -> tuple[int, int]:
    """How many tracked VMAs the snapshot's dump generated in one walk and in two."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    return log.count(ONE_WALK), log.count(TWO_WALKS)


async def test_one_walk_on_a_dump_and_dropped_pages_restore_as_zeros(guest: Workspace) -> None:
    g = Guest(guest)
    d0 = await g.ask("digest")
    async with await guest.snapshot() as s1:
        assert precopy_of(s1) is not None
        one, two = walks(s1)
        assert one == 0 and two > 0  # on the pre-copy: two walks, its markers skipped by their pagemap entries
        d1 = await g.ask("write 64")
        async with await guest.snapshot() as s2:
            one, two = walks(s2)
            assert one > 0 and two == 0  # every tracked VMA, on s1's pagemap
            stats = dump_stats(s2)
            assert stats["pages_skipped_parent"] >= BUF_PAGES - 64 and 64 <= stats["pages_written"] < BUF_PAGES // 4
            # written since s2, then dropped and not read again: neither present nor swapped at the dump (the
            # first pages are among the written ones: write K touches page 0), and the rest of the 32 unwritten
            d2 = await g.ask("write 64")
            assert await g.ask("drop 32") == "dropped"
            async with await guest.snapshot() as s3:
                assert walks(s3)[0] > 0
                d3 = await g.ask("digest")  # reads them: the zero page
                d4 = await g.ask("zap 64")  # the zero pages and 32 unwritten since s3 dropped, read again
                async with await guest.snapshot() as s4:
                    assert walks(s4)[0] > 0
                    assert len({d0, d1, d2, d3, d4}) == 5
                    assert await restored_digest(s4, g.n) == d4
                assert await restored_digest(s3, g.n - 2) == d3
            assert await restored_digest(s2, g.n - 4) == d1
        assert await restored_digest(s1, g.n - 5) == d0
