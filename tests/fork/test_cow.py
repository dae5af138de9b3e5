"""Copy-on-write restore (criu/patches/0001-cow-restore.patch, ``fork_mode == "criu-cow"``): copies of one snapshot
share its memory pages until they write them, the snapshot can go away while they live, writes stay private, and
copies of copies (whose memory is partly still the old image, never touched) carry exactly their parent's memory.
The KSM fallback (``BUNSHIN_FORK_MODE=ksm``) restores mergeable tasks and puts KSM's settings back. The tests marked
``tracked`` also run with write-tracked dumps (``criu-cow+track``), where a first snapshot of a workspace is a
pre-copy plus an incremental dump on it: its pages are in a chain of two image directories, and every assertion about
where a snapshot's pages live counts that chain (``_chain``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bunshin_async import Config, Snapshot, Workspace
from bunshin_async._fork import _dump, _modes
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host import _snapstore
from bunshin_async._workspace._accounting import pss_bytes

from .cow_host import get as _get
from .cow_host import start as _start

HEAP_MIB = 100
pytestmark = pytest.mark.tracked


def _pids(ws: Workspace) -> list[int]:
    assert ws.cgroup is not None
    return ws.cgroup.pids()


def _pss_kib(ws: Workspace) -> int:
    return pss_bytes(_pids(ws)) // 1024


def _image_maps(pid: int) -> list[tuple[int, int, str]]:
    """The mappings of (CoW-restored) pages images in ``pid``."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "/pages-" in fields[5] and ".img" in fields[5]:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi, fields[5]))
    return out


def _fault_in(ws: Workspace) -> int:
    """Read every page of every image mapping of ``ws`` through /proc/PID/mem (read faults map the image's pages,
    as a reader inside would), so that PSS counts all of them; returns the bytes mapped."""
    mapped = 0
    for pid in _pids(ws):
        maps = _image_maps(pid)
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            for lo, hi, _ in maps:
                for off in range(lo, hi, 1 << 20):
                    mem.seek(off)
                    mem.read(min(1 << 20, hi - off))
                mapped += hi - lo
    return mapped


@pytest.mark.fork_modes("criu-cow")
async def test_cow_copies_share_memory_until_written(
    ws: Workspace, fork_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _start(ws, HEAP_MIB)
    d0 = await _get(ws, "/digest")
    async with await ws.snapshot() as snap:
        monkeypatch.setenv("BUNSHIN_FORK_MODE", "criu")
        (stock,) = await Workspace.from_snapshot(snap, 1)
        try:
            assert stock.fork_mode == "criu"
            one_copy = _pss_kib(stock)
        finally:
            await stock.aclose()
        monkeypatch.setenv("BUNSHIN_FORK_MODE", "cow")
        copies = await Workspace.from_snapshot(snap, 8)
    chain = _chain(snap)
    try:
        # closed, but its copies map its pages images (and may dump incrementally on them)
        assert all(d.exists() for d in chain)
        assert [c.fork_mode for c in copies] == ["criu-cow"] * 8
        for c in copies:
            maps = [m for pid in _pids(c) for m in _image_maps(pid)]
            assert maps and all(path.startswith(tuple(f"{d}/images/pages-" for d in chain)) for _, _, path in maps)
            assert _fault_in(c) >= HEAP_MIB << 20
        total = sum(_pss_kib(c) for c in copies)
        print(f"PSS: one stock copy {one_copy / 1024:.1f} MiB, 8 CoW copies {total / 1024:.1f} MiB in all")
        assert total <= 1.6 * one_copy, (total, one_copy)
        for c in copies:
            assert await _get(c, "/digest") == d0
        # Writes stay private to the copy that makes them.
        assert await _get(copies[0], "/write/7") == "ok"
        d7 = await _get(copies[0], "/digest")
        assert d7 != d0
        for c in [*copies[1:], ws]:
            assert await _get(c, "/digest") == d0
    finally:
        for c in copies:
            await c.aclose()
    assert not any(d.exists() for d in chain)  # gone with its last copy


def _chain(snap: Snapshot) -> list[Path]:
    """The snapshot's directory and those its images are incremental on (its pre-copy when tracked), nearest first."""
    out: list[Path] = []
    cur: Path | None = record_of(snap).path
    while cur is not None:
        out.append(cur)
        cur = _snapstore.mem_parent_of(cur)
    return out


def _pages_bytes(snap: Snapshot) -> int:
    return sum(p.stat().st_size for p in record_of(snap).images.glob("pages-*.img"))


def _chain_pages_bytes(snap: Snapshot) -> int:
    """The pages its whole chain holds: what a copy of ``snap`` is restored from."""
    return sum(p.stat().st_size for d in _chain(snap) for p in (d / "images").glob("pages-*.img"))


@pytest.mark.fork_modes("criu-cow")
async def test_cow_nested_fork_dumps_only_what_the_copy_wrote(ws: Workspace, fork_mode: str) -> None:
    """criu/patches/0002: a dump of a CoW copy refers to its parent image for the pages the copy never wrote, so
    its image holds about what the copy dirtied; restores of it (three generations deep) carry the exact memory,
    and the chain outlives the copies and snapshots it was made from."""
    await _start(ws, 40)
    async with await ws.snapshot() as base:
        full = _chain_pages_bytes(base)
        assert full >= 40 << 20
        base_depth = len(_chain(base))
        assert base_depth == (2 if Config.current().track_writes else 1)  # tracked: the pre-copy, the dump on it
        (current,) = await Workspace.from_snapshot(base)
    made = [current]
    try:
        for gen in range(2, 5):
            assert await _get(current, f"/dirty/{gen}/4") == "ok"
            async with await current.snapshot() as snap:
                # Hashing allocates (Python writes memory to read it): digests are taken after the dump, and on a
                # second copy, so that the next generation's image holds only what /dirty wrote.
                expected = await _get(current, "/digest")
                assert (record_of(snap).path / "parent").read_text() == current._core.mem_parent.name  # type: ignore[union-attr]
                assert _pages_bytes(snap) < full / 4, (gen, _pages_bytes(snap), full)
                if gen == 4:  # the copy it was taken from, and that copy's own snapshot, go first
                    for c in made:
                        await c.aclose()
                    made = []
                current, probe = await Workspace.from_snapshot(snap, 2)
            made.append(current)
            try:
                assert current.fork_mode == probe.fork_mode == "criu-cow"
                assert await _get(probe, "/digest") == expected, f"generation {gen}"
            finally:
                await probe.aclose()
        assert _snapstore.mem_chain_depth(current._core.mem_parent) == base_depth + 3  # type: ignore[arg-type]
    finally:
        for c in made:
            await c.aclose()


@pytest.mark.fork_modes("criu-cow")
async def test_cow_chain_runs_to_its_limit(ws: Workspace, fork_mode: str) -> None:
    """Copies forked from copies, a little written in each generation: each dump is incremental on the last until
    the chain holds ``MAX_MEM_CHAIN`` images (a restore then maps pages from 14 parent images, within the patch's
    ``COW_MAX_SRC``), every generation restores the exact memory, and the dump after that is a full one (the first
    fork's chain is 1 deep, or 2 when tracked: the pre-copy and the dump on it)."""
    await _start(ws, 8)
    (current,) = await ws.fork()
    depth = _snapstore.mem_chain_depth(current._core.mem_parent)  # type: ignore[arg-type]
    assert depth == (2 if Config.current().track_writes else 1)
    want: list[int] = []  # each dump one deeper than its parent's chain, a whole one once that is full
    for _ in range(2, _snapstore.MAX_MEM_CHAIN + 2):
        depth = 1 if depth >= _snapstore.MAX_MEM_CHAIN else depth + 1
        want.append(depth)
    assert _snapstore.MAX_MEM_CHAIN in want and 1 in want  # the limit is reached within the test
    depths: list[int] = []
    try:
        for gen in range(2, _snapstore.MAX_MEM_CHAIN + 2):
            assert await _get(current, f"/dirty/{gen}/1") == "ok"
            async with await current.snapshot() as snap:
                expected = await _get(current, "/digest")
                depths.append(_snapstore.mem_chain_depth(record_of(snap).path))
                (after,) = await Workspace.from_snapshot(snap)
            await current.aclose()
            current = after
            assert await _get(current, "/digest") == expected, f"generation {gen}, chain {depths[-1]}"
    finally:
        await current.aclose()
    assert depths == want


@pytest.mark.fork_modes("criu-cow")
async def test_cow_chain_is_bounded(ws: Workspace, fork_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_dump, "MAX_MEM_CHAIN", 1)
    await _start(ws, 20)
    (c1,) = await ws.fork()
    try:
        async with await c1.snapshot() as snap:
            assert not (record_of(snap).path / "parent").exists()  # a full dump: the chain would be too long
            assert _pages_bytes(snap) >= 20 << 20
            (c2,) = await Workspace.from_snapshot(snap)
        try:
            assert await _get(c2, "/digest") == await _get(c1, "/digest")
        finally:
            await c2.aclose()
    finally:
        await c1.aclose()


@pytest.mark.fork_modes("criu-cow")
async def test_cow_fork_of_fork_carries_untouched_pages(ws: Workspace, fork_mode: str) -> None:
    """Each generation rewrites half of its heap and is forked at once: the copy's memory is partly CoW-written,
    partly image pages it never touched (not in pagemap until the dump populates them)."""
    await _start(ws, 30)
    current, made = ws, []
    try:
        for gen in range(1, 4):
            assert await _get(current, f"/write/{gen}") == "ok"
            (child,) = await current.fork()
            made.append(child)
            assert child.fork_mode == "criu-cow"
            expected = await _get(current, "/digest")  # the parent's memory as it was forked (no write since)
            assert await _get(child, "/digest") == expected, f"generation {gen}"
            current = child
        g1, g2, g3 = [await _get(c, "/digest") for c in made]
        assert g1 != g2 == g3  # generation 2 wrote before it was forked; generation 3 did not write
    finally:
        for c in made:
            await c.aclose()


@pytest.mark.fork_modes("criu-cow")
async def test_a_copy_that_maps_none_of_its_images_holds_no_snapshot(ws: Workspace, fork_mode: str) -> None:
    """A CoW restore maps runs of at least 16 pages of plain anonymous memory and reads the rest: a copy of an idle
    workspace (its init and agent) maps nothing of its snapshot. Such a copy lets go of the snapshot's directory at
    once: a rollout that commits a speculated write in every turn is a copy of a copy of ..., and each would
    otherwise keep its snapshot (every image file, not only pages) for the rest of its life, each incremental on
    the one before (issue 38: 0.27 MiB more per commit on a shell workspace). Its memory is private, so its own
    snapshots are whole ones; every generation carries the state."""
    store = _snapstore.snapshot_dir()

    def holders() -> set[str]:
        """Who holds a snapshot directory in the store (a copy by its id, a snapshot by ``snapshot-<id>``)."""
        return {u.name for d in store.glob("*.users") for u in d.iterdir()}

    current, made = ws, []
    try:
        for gen in range(1, 4):
            await current.exec(f"echo {gen} > /workspace/gen")
            (child,) = await current.fork()
            made.append(child)
            assert child.fork_mode == "criu-cow"
            assert not [m for pid in _pids(child) for m in _image_maps(pid)]
            assert child.id not in holders()
            if not Config.current().track_writes:  # tracked, a workspace holds its last dump for the next one
                assert not [d for d in store.iterdir() if not d.name.startswith(".")], "a snapshot outlived its fork"
            assert (await child.exec("cat /workspace/gen")).stdout.strip() == str(gen)
            if current is not ws:  # the commit: the rollout moves into its fork
                await current.aclose()
                made.remove(current)
            current = child
        (last,) = await current.fork()  # a fork of a copy that held nothing: a whole dump, the same state
        made.append(last)
        assert (await last.exec("cat /workspace/gen")).stdout.strip() == "3"
    finally:
        for c in made:
            await c.aclose()


@pytest.mark.fork_modes("criu-cow")
async def test_cow_rollback_keeps_memory(ws: Workspace, fork_mode: str) -> None:
    await _start(ws, 20)
    d0 = await _get(ws, "/digest")
    async with await ws.snapshot() as snap:
        await _get(ws, "/write/3")
        assert await _get(ws, "/digest") != d0
        await ws.rollback(snap)
        assert ws.fork_mode == "criu-cow"
        assert await _get(ws, "/digest") == d0
        await _get(ws, "/write/4")
    assert await _get(ws, "/digest") not in ("", d0)  # the snapshot is gone; the memory still reads


@pytest.mark.fork_modes("criu")
async def test_ksm_fallback(ws: Workspace, fork_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {n: (_modes.KSM_DIR / n).read_text().strip() for n in _modes.KSM_TUNING}
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "ksm")
    await _start(ws, 10)
    d0 = await _get(ws, "/digest")
    try:
        copies = await ws.fork(2)
        try:
            assert [c.fork_mode for c in copies] == ["criu-ksm"] * 2
            assert (_modes.KSM_DIR / "run").read_text().strip() == "1"
            for c in copies:
                assert await _get(c, "/digest") == d0
                for pid in _pids(c):
                    stat = Path(f"/proc/{pid}/ksm_stat").read_text()
                    assert "ksm_merge_any: yes" in stat, stat
        finally:
            for c in copies:
                await c.aclose()
    finally:
        _modes.ksm_restore()
    assert {n: (_modes.KSM_DIR / n).read_text().strip() for n in _modes.KSM_TUNING} == before


def test_restore_mode_never_pretends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "criu")
    assert _modes.restore_mode() == "criu"
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "auto")
    assert _modes.restore_mode() == ("criu-cow" if _modes.cow_available() else "criu")
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "bogus")
    with pytest.raises(ValueError):
        _modes.restore_mode()
