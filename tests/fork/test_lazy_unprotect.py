"""A dump makes a process's unreadable VMAs readable (the parasite's ``mprotect``, and back after) only when it has
pages of one of them to copy (criu/patches/0026, issue 39): a malloc arena's ``PROT_NONE`` reservation holds none, and
making 128 MiB of them readable and back cost the guest's dump two parasite round trips and two page-table walks
with the tree frozen. A ``PROT_NONE`` mapping that holds data is still made readable, copied and restored unreadable
with its data. CRIU's log says which it
did (log level 3); copies are checked by digest, never by timing."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork._snapshot import record_of

from .conftest import track_guest
from .test_smaps_early import guest_pid
from .test_track_writes import Guest

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

LAZY_UNPROTECT = "lazy-unprotect"  # the feature criu/patches/0026 adds to `criu --version`


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (LAZY_UNPROTECT, "0026"), log=True) as w:
        yield w


def unprotected(snap: Snapshot, pid: int) -> tuple[int, str, int]:
    """What the dump did with ``pid``'s VMAs without ``PROT_READ``: how many, what, iovs in them."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    [(n, what, iovs)] = re.findall(rf"\b{pid}: (\d+) VMAs without PROT_READ, (.*) \((\d+) iovs in them\)", log)
    return int(n), what, int(iovs)


async def test_an_empty_reservation_is_left_unreadable(guest: Workspace) -> None:
    g = Guest(guest)
    d0 = await g.ask("digest")
    pid = guest_pid(guest)
    async with await guest.snapshot() as s1:
        n, what, iovs = unprotected(s1, pid)
        assert n >= 1 and what == "none dumped: left as they are" and iovs == 0  # track_guest's 32 MiB reservation
        [copy] = await Workspace.from_snapshot(s1)
        try:
            c = Guest(copy, g.n)
            assert await c.ask("digest") == d0
            assert await c.ask("open") == await g.ask("open")  # restored PROT_NONE and empty: readable zeros now
        finally:
            await copy.aclose()


async def test_an_unreadable_mapping_with_data_is_copied(guest: Workspace) -> None:
    g = Guest(guest)
    await g.ask("hide")  # 16 filled pages, then PROT_NONE
    pid = guest_pid(guest)
    n1 = g.n
    async with await guest.snapshot() as s1, await guest.snapshot() as s2:
        for snap in (s1, s2):  # a dump has no parent for a VMA without PROT_READ (generate_vma_iovs): whole each time
            n, what, iovs = unprotected(snap, pid)
            assert n >= 2 and what == "made readable" and iovs >= 1
        shown = await g.ask("show")
        for snap in (s1, s2):  # each copy restores the mapping unreadable with its pages: made readable, the same data
            [copy] = await Workspace.from_snapshot(snap)
            try:
                assert await Guest(copy, n1).ask("show") == shown
            finally:
                await copy.aclose()
