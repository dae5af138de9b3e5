"""Write tracking leaves a VMA without access (``PROT_NONE``) unregistered (criu/patches/0034, issue 39): arming puts
uffd-wp PTE markers in every hole of what it protects, and a malloc arena's 64 MiB reservation became 16k markers
that every later dump walked (127 MiB of them in fork_bench's guest). track_guest.py's 32 MiB reservation holds no
marker after tracked snapshots; made readable (``open``), it is dumped whole once and then armed like any untracked
VMA; every snapshot restores to the guest's digest. Counts from smaps and pagemap, never timings."""

from __future__ import annotations

import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bunshin_async import Workspace

from .conftest import track_guest
from .test_smaps_early import guest_pid
from .test_track_writes import Guest, restored_digest

pytestmark = [pytest.mark.fork_modes("criu-cow")]

WP_SKIP_NONE = "wp-skip-none"  # the feature criu/patches/0034 adds to `criu --version`
RESERVED_KIB = 32 << 10  # track_guest.py's reservation
PM_SWAP = 1 << 62
SWP_PTE_MARKER = 31  # a PTE marker's swap type in pagemap (include/linux/swap.h), readable as root


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (WP_SKIP_NONE, "0034"), track=True) as w:
        yield w


def reservation(pid: int) -> tuple[str, bool, int]:
    """track_guest.py's 32 MiB reservation: its permissions, whether it is registered (smaps ``uw``) and how many
    PTE markers its pagemap shows."""
    found = []
    start = end = 0
    perms = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            start, end, perms = lo, hi, fields[1]
        elif fields[0] == "VmFlags:" and end - start == RESERVED_KIB << 10:
            found.append((start, end, perms, "uw" in fields[1:]))
    assert len(found) == 1, found
    [(start, end, perms, registered)] = found
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        raw = os.pread(fd, (end - start) // 4096 * 8, start // 4096 * 8)
    finally:
        os.close(fd)
    entries = struct.unpack(f"{len(raw) // 8}Q", raw)
    markers = sum(1 for e in entries if e & PM_SWAP and e & 0x1F == SWP_PTE_MARKER)
    return perms, registered, markers


async def test_a_reservation_is_not_armed_until_it_is_accessible(guest: Workspace) -> None:
    g = Guest(guest)
    d0 = await g.ask("digest")
    pid = guest_pid(guest)
    async with await guest.snapshot() as s1:  # a pre-copy, which arms, and a dump on it
        assert reservation(pid) == ("---p", False, 0)
        d1 = await g.ask("write 64")
        async with await guest.snapshot() as s2:
            assert reservation(pid) == ("---p", False, 0)
            d2 = await g.ask("open")  # PROT_READ now: its zeros join the digest
            async with await guest.snapshot() as s3:  # dumped whole (nothing: no page), then armed
                perms, registered, _ = reservation(pid)
                assert perms == "r--p" and registered
                d3 = await g.ask("write 64")
                async with await guest.snapshot() as s4:
                    assert len({d0, d1, d2, d3}) == 4
                    assert await restored_digest(s4, g.n) == d3
                assert await restored_digest(s3, g.n - 1) == d2
            assert await restored_digest(s2, g.n - 2) == d1
        assert await restored_digest(s1, g.n - 3) == d0
