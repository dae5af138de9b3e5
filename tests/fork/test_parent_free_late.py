"""The parent pagemaps a dump's CRIU read before the freeze (criu/patches/0027) are freed after its answer, not when
each process's page transfer closes with the tree frozen (criu/patches/0031, issue 39: 0.25-0.3 ms of a write-tracked
guest's page dump). A parent read frozen is freed as before. Checked by CRIU's log (level 3) and the copies' digests,
never by timing."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork import _dump
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._wptrack import WP_TRACK

from .conftest import track_guest
from .test_parent_early import told_the_first
from .test_track_writes import Guest, restored_digest

pytestmark = pytest.mark.fork_modes("criu-cow")

PARENT_FREE_LATE = "parent-free-late"  # the feature criu/patches/0031 adds to `criu --version`
FREED = re.compile(r"parent pagemaps read before the freeze: (\d+) freed after the answer")


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (WP_TRACK, "0013"), (PARENT_FREE_LATE, "0031"), log=True, track=True) as w:
        yield w


def _lines(snap: Snapshot) -> list[str]:
    return (record_of(snap).images / "dump.log").read_text(errors="replace").splitlines()


def _closes(lines: list[str]) -> list[int]:
    """Each process's page transfer close (criu/patches/0022's line), in microseconds."""
    return [int(m[1]) for line in lines if (m := re.search(r"Pages of \d+: .*, close (\d+) us;", line))]


async def test_the_early_parents_are_freed_after_the_answer(guest: Workspace) -> None:
    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot() as s1:
        d2 = await g.ask("write 64")
        async with await guest.snapshot() as s2:
            lines = _lines(s2)
            used = sum("parent pagemap of" in line and "read before the freeze" in line for line in lines)
            freed = [(i, int(m[1])) for i, line in enumerate(lines) if (m := FREED.search(line))]
            assert len(freed) == 1 and used >= 3 and freed[0][1] >= used, (used, freed)  # init, agent, guest
            unfrozen = next(i for i, line in enumerate(lines) if "Unfreezing tasks" in line)
            assert freed[0][0] > unfrozen
            assert len(_closes(lines)) >= 3
            assert await restored_digest(s2, g.n) == d2
        assert await restored_digest(s1, g.n - 1) != d2


async def test_a_parent_read_frozen_is_freed_as_before(guest: Workspace) -> None:
    # every parent is read frozen and closed with its transfer; the early reads of s1, never used, are freed after
    # the answer
    async with told_the_first(guest) as s3:
        lines = _lines(s3)
        assert not any("parent pagemap of" in ln and "read before the freeze (" in ln for ln in lines)
        assert [int(m[1]) for line in lines if (m := FREED.search(line))][0] >= 3


async def test_without_the_ready_check_nothing_is_left_to_free(
    guest: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_dump, "OVERLAP", False)  # no ready check: no early read
    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot():
        d2 = await g.ask("write 64")
        async with await guest.snapshot() as s2:
            assert not any(FREED.search(line) for line in _lines(s2))
            assert await restored_digest(s2, g.n) == d2
