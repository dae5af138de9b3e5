"""Write tracking between dumps (``Config.track_writes``, criu/patches/0013, docs/concepts/fork-pause.md): the first
snapshot is a pre-copy while the workspace runs, then a dump of what was written meanwhile; a checkpoint of a
workspace that keeps running writes only the pages written since the previous one, and every snapshot of the chain
restores exactly; a failed dump drops the tracking (the tasks are unregistered) and the next snapshot starts over
with a pre-copy; a failed pre-copy leaves a whole dump; without the setting nothing is tracked. Page counts from
CRIU's stats and digests, never timings."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from bunshin_async import ForkError, Snapshot, Workspace
from bunshin_async._fork import _dump
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host import _wptrack
from bunshin_async._host._criu import SwrkCriu, rpc
from bunshin_async._host._wptrack import WP_TRACK

from .conftest import track_guest
from .test_rollback_faults import KillCriuAt

BUF_PAGES = 16 << 8  # track_guest.py's 16 MiB buffer


@pytest.fixture
async def guest(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    async with track_guest(monkeypatch, (WP_TRACK, "0013"), track=True) as w:
        yield w


class Guest:
    """Requests to one workspace's track_guest.py (a copy continues its parent's numbering)."""

    def __init__(self, ws: Workspace, n: int = 0) -> None:
        self.ws, self.n = ws, n

    async def ask(self, cmd: str) -> str:
        n, self.n = self.n, self.n + 1
        # a hang guard, generous (test_smaps_early's lock case once timed out on the loaded machine, unexplained),
        # over the request too, and saying which request it was
        with anyio.move_on_after(120) as waited:
            await self.ws.write_file(f"/workspace/req-{n}", cmd)
            while (r := await self.ws.exec(f"cat /workspace/ans-{n} 2>/dev/null")).exit_code:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        if waited.cancelled_caught:
            raise AssertionError(f"track_guest.py in {self.ws.id} did not answer request {n} ({cmd!r}) in 120 s")
        return r.stdout.strip()


def dump_stats(snap: Snapshot) -> dict[str, int]:
    """CRIU's stats-dump image of the snapshot: pages written and pages left to the parent images."""
    return dump_stats_dir(record_of(snap).path)


def dump_stats_dir(path: Path) -> dict[str, int]:
    import pycriu.images  # on sys.path once bunshin_async._host._criu is imported

    with open(path / "images" / "stats-dump", "rb") as f:
        entry: dict[str, Any] = pycriu.images.load(f)["entries"][0]["dump"]
    return {k: int(entry.get(k, 0)) for k in ("pages_written", "pages_skipped_parent")}


def tracked_vmas(ws: Workspace) -> int:
    """VMAs of the workspace's processes registered with a userfaultfd in write-protect mode (smaps ``uw``)."""
    assert ws.cgroup is not None
    count = 0
    for pid in ws.cgroup.pids():
        try:
            smaps = Path(f"/proc/{pid}/smaps").read_text()
        except OSError:
            continue
        count += sum(1 for line in smaps.splitlines() if line.startswith("VmFlags:") and " uw" in line)
    return count


async def restored_digest(snap: Snapshot, n: int) -> str:
    [copy] = await Workspace.from_snapshot(snap)
    try:
        return await Guest(copy, n).ask("digest")
    finally:
        await copy.aclose()


def precopy_of(snap: Snapshot) -> Path | None:
    """The pre-copy directory the snapshot's images are incremental on, if that is what its parent is."""
    path = record_of(snap).path
    try:
        pre = path.with_name((path / "parent").read_text().strip())
    except FileNotFoundError:
        return None
    return pre if (pre / "images" / "pre-dump.log").is_file() else None


async def test_checkpoints_write_only_what_changed(guest: Workspace) -> None:
    g = Guest(guest)
    d0 = await g.ask("digest")
    async with await guest.snapshot() as s1:
        first = dump_stats(s1)
        pre = precopy_of(s1)
        assert pre is not None  # the first snapshot pre-copied, then dumped what was written meanwhile
        assert dump_stats_dir(pre)["pages_written"] > BUF_PAGES
        assert first["pages_skipped_parent"] >= BUF_PAGES and first["pages_written"] < BUF_PAGES
        assert guest._core.tracking.uffds and guest._core.tracking.parent == record_of(s1).path
        assert tracked_vmas(guest) > 0
        d1 = await g.ask("write 64")
        async with await guest.snapshot() as s2:
            second = dump_stats(s2)
            # the buffer's unwritten pages are left to s1; what is written is the 64 pages and what the
            # interpreter touched, far less than the buffer
            assert second["pages_skipped_parent"] >= BUF_PAGES - 64
            assert 64 <= second["pages_written"] < BUF_PAGES // 4
            d2 = await g.ask("map 4")  # a new VMA: untracked, dumped whole, then armed
            d3 = await g.ask("zap 16")  # dropped pages: zeros in the copy, not the parent's old content
            async with await guest.snapshot() as s3:
                third = dump_stats(s3)
                assert third["pages_written"] >= 4 << 8 and third["pages_skipped_parent"] >= BUF_PAGES - 64 - 16
                assert len({d0, d1, d2, d3}) == 4
                assert await restored_digest(s3, g.n) == d3
            assert await restored_digest(s2, g.n - 2) == d1
        assert await restored_digest(s1, g.n - 3) == d0


async def test_failed_dump_drops_tracking(guest: Workspace) -> None:
    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot():
        assert tracked_vmas(guest) > 0
        d1 = await g.ask("write 64")
        with pytest.raises(ForkError):
            await _dump.snapshot(guest._core, KillCriuAt("post-dump"))
        # The killed dump re-armed pages it never kept: the uffds are closed, which unregisters every VMA.
        assert guest._core.tracking.uffds == [] and guest._core.tracking.parent is None
        assert tracked_vmas(guest) == 0
        async with await guest.snapshot() as s3:
            pre = precopy_of(s3)  # started over: a new pre-copy, not the snapshot before the failure
            assert pre is not None and dump_stats_dir(pre)["pages_skipped_parent"] == 0
            assert tracked_vmas(guest) > 0
            assert await restored_digest(s3, g.n) == d1


async def test_a_failed_dump_closes_its_uffds_off_the_event_loop(
    guest: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing a uffd walks its task's mappings under the mmap lock (``userfaultfd_release()``): the failed dump's
    closes (the tracking it drops and the uffds it got) run in a worker thread, and all of them."""
    real_close = os.close
    closes: list[int] = []  # the thread of each uffd closed

    def close(fd: int) -> None:
        if _wptrack.is_uffd(fd):
            closes.append(threading.get_ident())
        real_close(fd)

    g = Guest(guest)
    await g.ask("digest")
    async with await guest.snapshot():
        held = len(guest._core.tracking.uffds)
        assert held > 0
        monkeypatch.setattr(os, "close", close)
        with pytest.raises(ForkError):
            await _dump.snapshot(guest._core, KillCriuAt("post-dump"))
        monkeypatch.undo()
        assert guest._core.tracking.uffds == [] and tracked_vmas(guest) == 0
        assert len(closes) >= held and threading.get_ident() not in closes


class FailPreDump(SwrkCriu):
    """Fault injection at the backend interface: every pre-dump fails as a CRIU error would."""

    async def call(self, req: Any, **kw: Any) -> Any:
        if req.type == rpc.PRE_DUMP:
            raise ForkError("criu pre_dump failed (injected)", workspace_id="")
        return await super().call(req, **kw)


async def test_failed_precopy_leaves_a_whole_dump(guest: Workspace) -> None:
    g = Guest(guest)
    d0 = await g.ask("digest")
    async with await _dump.snapshot(guest._core, FailPreDump()) as s1:
        assert precopy_of(s1) is None and not (record_of(s1).path / "parent").exists()
        assert dump_stats(s1)["pages_skipped_parent"] == 0  # whole, and armed
        assert guest._core.tracking.parent == record_of(s1).path and tracked_vmas(guest) > 0
        assert await restored_digest(s1, g.n) == d0


async def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BUNSHIN_TRACK_WRITES", raising=False)
    async with track_guest(monkeypatch) as w:
        g = Guest(w)
        await g.ask("digest")
        async with await w.snapshot():
            assert w._core.tracking.uffds == [] and tracked_vmas(w) == 0
            await g.ask("write 64")
            async with await w.snapshot() as s2:
                assert dump_stats(s2)["pages_skipped_parent"] == 0


async def test_one_dump_holds_at_most_max_uffds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A workspace of more processes than ``MAX_UFFDS`` (one uffd each) cannot make one dump hand this process
    more descriptors than the bound: the extra ones are closed, the dump's tracking is not kept (the next dump is
    whole) and nothing stays registered."""
    monkeypatch.setenv("BUNSHIN_TRACK_WRITES", "1")
    monkeypatch.setattr(_wptrack, "MAX_UFFDS", 3)
    async with Workspace() as w:
        for _ in range(6):
            await w.spawn(["sleep", "1000"])
        async with await w.snapshot() as s1:
            assert w._core.tracking.uffds == [] and w._core.tracking.parent is None
            assert tracked_vmas(w) == 0
            async with await w.snapshot() as s2:
                assert dump_stats(s2)["pages_skipped_parent"] == 0
                assert dump_stats(s1)["pages_written"] > 0


async def test_the_process_holds_at_most_its_budget_of_uffds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workspaces each under ``MAX_UFFDS`` cannot together hold more than the process's budget: a dump that would
    pass it keeps no tracking, and what a closed workspace held is counted free again."""
    monkeypatch.setenv("BUNSHIN_TRACK_WRITES", "1")
    async with Workspace() as a, Workspace() as b:
        await a.spawn(["sleep", "1000"])
        await b.spawn(["sleep", "1000"])
        async with await a.snapshot():
            held = len(a._core.tracking.uffds)
            assert held >= 2  # pid 1, the agent, the sleep: each armed
            monkeypatch.setattr(_wptrack, "budget", lambda: held + 1)
            async with await b.snapshot():
                assert b._core.tracking.uffds == [] and tracked_vmas(b) == 0
                assert len(a._core.tracking.uffds) == held
        await a.aclose()
        async with await b.snapshot():
            assert 2 <= len(b._core.tracking.uffds) <= held
