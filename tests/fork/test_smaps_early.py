"""A dump's CRIU reads the tree's /proc/PID/smaps (a walk of every page table) while the tree still runs, and frozen
only /proc/PID/maps, reusing what smaps said of a process whose mappings are unchanged (criu/patches/0015,
docs/concepts/fork-pause.md); a process that maps, unmaps or changes a mapping's protection between that read and
the freeze is read again frozen and restores exactly as it was when frozen. CRIU's log says which it did (log level
3); the copies are checked by digest, never by timing."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork import _dump
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import SwrkCriu

from .conftest import track_guest
from .test_track_writes import Guest, restored_digest

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

SMAPS_EARLY = "smaps-early"  # the feature criu/patches/0015 adds to `criu --version`


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (SMAPS_EARLY, "0015"), log=True) as w:
        yield w


class ChangeBeforeFreeze(SwrkCriu):
    """The real backend; ``change`` runs once CRIU has answered its ready check (when it reads the tree's smaps)
    and before the workspace is drained and frozen."""

    def __init__(self, change: Callable[[], Awaitable[Any]]) -> None:
        super().__init__()
        self.change = change

    async def call(self, req: Any, *, ready: Callable[[], Awaitable[None]] | None = None, **kw: Any) -> Any:
        if ready is None:  # a pre-copy's call
            return await super().call(req, **kw)
        inner = ready

        async def changed_then_ready() -> None:
            await self.change()
            await inner()

        return await super().call(req, ready=changed_then_ready, **kw)


def early_reads(snap: Snapshot, pid: int) -> list[str]:
    """What CRIU's dump log says it did with ``pid``'s smaps read before the freeze (one entry per read)."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    return re.findall(rf"smaps of {pid}: read before the freeze \(\d+ us\), (.*)", log)


def guest_pid(ws: Workspace) -> int:
    """The host pid of the workspace's track_guest.py."""
    assert ws.cgroup is not None
    for pid in ws.cgroup.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"/workspace/track_guest.py" in cmdline:
            return pid
    raise AssertionError("track_guest.py is not running")


async def test_unchanged_mappings_are_not_read_again_frozen(guest: Workspace) -> None:
    g = Guest(guest)
    d0 = await g.ask("digest")
    pid = guest_pid(guest)
    async with await guest.snapshot() as s1:
        [read] = early_reads(s1, pid)
        assert re.fullmatch(r"its \d+ mappings unchanged \(maps\): used", read), read
        assert await restored_digest(s1, g.n) == d0


@pytest.mark.parametrize(
    ("change", "why"),
    [("map 4", "its mappings changed"), ("open", "its mappings changed"), ("lock", "its locked memory changed")],
)
async def test_a_mapping_changed_after_the_early_read_is_read_again(guest: Workspace, change: str, why: str) -> None:
    g = Guest(guest)
    await g.ask("digest")
    pid = guest_pid(guest)
    changed: list[str] = []

    async def mutate() -> None:
        changed.append(await g.ask(change))

    async with await _dump.snapshot(guest._core, ChangeBeforeFreeze(mutate)) as s1:
        assert len(changed) == 1
        assert early_reads(s1, pid) == [f"read again frozen: {why}"]
        # the copy holds the new mapping / the reservation readable / the mapping locked (a stale VMA list would
        # lose the first and leave the second PROT_NONE, and its guest would die answering; stale flags would
        # leave the third unlocked, and its VmLck would differ)
        assert await restored_digest(s1, g.n) == changed[0]
    assert await g.ask("digest") == changed[0]
