"""One parasite call fills up to eight page pipe buffers, whose pipes go to it in one message (criu/patches/0024,
docs/concepts/fork-pause.md): a call per buffer cost an RPC round trip each with the tree frozen, 22 for a
write-tracked checkpoint's ~3000 scattered pages. CRIU's log counts the buffers written and the parasite's calls;
the copy has the guest's digest (a buffer filled from the wrong iovs, or not at all, would change it). Counts and
digests, never timings."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork._snapshot import record_of

from .conftest import track_guest
from .test_track_writes import Guest, restored_digest

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

BATCH = "parasite-batch"  # the feature criu/patches/0024 adds to `criu --version`


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (BATCH, "0024"), log=True) as w:
        yield w


def largest_dump(snap: Snapshot) -> tuple[int, int]:
    """Of the snapshot's process whose page dump wrote the most buffers: (buffers written, parasite calls)."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    out = []
    for part in re.split(r"Dumping pages \(type: \d+ pid: \d+\)", log)[1:]:
        buffers = sum(int(b) for b in re.findall(r"Pages written: \d+ in (\d+) batches", part))
        [calls] = re.findall(r"Pages of \d+: .*parasite \d+ us \((\d+) calls", part)
        out.append((buffers, int(calls)))
    return max(out)


async def test_a_parasite_call_fills_several_buffers(guest: Workspace) -> None:
    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot():
        digest = await g.ask("write 1024")  # a page in each of 1024 spread over the 16 MiB buffer: runs of one
        async with await guest.snapshot() as snap:
            buffers, calls = largest_dump(snap)
            assert buffers >= 4  # a buffer's pipe holds at most 256 pages
            assert 1 <= calls < buffers, (buffers, calls)  # a call per buffer would be as many
            assert await restored_digest(snap, g.n) == digest
