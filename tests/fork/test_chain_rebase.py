"""A rolled-back workspace whose image chain reaches ``MAX_MEM_CHAIN`` (``_dump._rebases``, ``_restore.rebase``): a
rollback makes the workspace a CoW copy of its target, whose dumps are incremental on the image it maps
(criu/patches/0002), one deeper; rolling back to one of those goes one deeper again. At the limit the dump is whole
and the workspace is restored in place from it, so that the checkpoints after it are incremental again (on that one
image) instead of whole until the next rollback. Counts and digests only (pages written, chain depths), never times.
Marked ``tracked``: with write-tracked dumps the first snapshot is a pre-copy plus a dump on it, one deeper."""

from __future__ import annotations

import anyio
import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork import _restore
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host import _snapstore

from .cow_host import get as _get
from .cow_host import start

MIB = 16
pytestmark = pytest.mark.tracked


def _depth(snap: Snapshot) -> int:
    return _snapstore.mem_chain_depth(record_of(snap).path)


def _pages_bytes(snap: Snapshot) -> int:
    return sum(p.stat().st_size for p in record_of(snap).images.glob("pages-*.img"))


@pytest.mark.fork_modes("criu-cow")
async def test_a_rolled_back_workspace_checkpoints_incrementally_past_the_chain_limit(
    ws: Workspace, fork_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rolled back to its last snapshot before each step, the workspace's chain grows by one per step until it is
    ``MAX_MEM_CHAIN`` deep; the next snapshot is whole (depth 1) and re-bases the workspace on itself, and the two
    checkpoints after it (no rollback in between) are incremental on it (depth 2, under a third of its pages, as
    the ones before the limit were).
    A call made while the workspace is restored in place waits and then runs in the restored workspace, which has
    the memory it had; a copy of every snapshot serves the digest the workspace had when it was taken."""
    await start(ws, MIB)
    rebased = anyio.Event()
    real_rebase = _restore.rebase

    async def rebase(*args: object) -> None:
        rebased.set()  # the drain holds calls from here until the restore is done
        await real_rebase(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_restore, "rebase", rebase)
    snaps: list[Snapshot] = []
    digests: list[str] = []
    try:
        depth = 0
        while depth < _snapstore.MAX_MEM_CHAIN:  # rolled back to the last snapshot before each step: one deeper
            if snaps:
                await ws.rollback(snaps[-1])
            assert await _get(ws, f"/dirty/{len(snaps)}/1") == "ok"
            snaps.append(await ws.snapshot())
            digests.append(await _get(ws, "/digest"))
            assert _depth(snaps[-1]) == (depth + 1 if depth else _depth(snaps[0])), [_depth(s) for s in snaps]
            depth = _depth(snaps[-1])
        assert len(snaps) >= _snapstore.MAX_MEM_CHAIN - 1
        chained = [_pages_bytes(s) for s in snaps[1:]]  # incremental up to the limit (the first is whole)

        await ws.rollback(snaps[-1])  # maps a chain MAX_MEM_CHAIN deep: its next dump cannot be incremental
        assert await _get(ws, "/dirty/100/1") == "ok"
        dirtied = await _get(ws, "/digest")
        async with anyio.create_task_group() as tg:
            during: list[str] = []

            async def call_while_restored() -> None:
                await rebased.wait()
                during.append((await ws.exec("echo held")).stdout)

            tg.start_soon(call_while_restored)
            whole = await ws.snapshot()
            if not rebased.is_set():  # no restore in place: nothing to make the call for
                tg.cancel_scope.cancel()
        snaps.append(whole)
        digests.append(dirtied)
        assert during == ["held\n"]
        assert _depth(whole) == 1 and not (record_of(whole).path / "parent").exists()
        assert _pages_bytes(whole) >= MIB << 20  # whole
        assert max(chained) < _pages_bytes(whole) / 3, (chained, _pages_bytes(whole))
        assert ws._core.mem_parent == record_of(whole).path  # re-based: it maps the whole dump's image

        # No rollback from here, and no digest of the workspace before its last dump: reading its heap writes to
        # its pages (Python's reference counts), which the next dump would carry.
        for step in (101, 102):  # incremental on the whole dump, which it maps
            assert await _get(ws, f"/dirty/{step}/1") == "ok"
            snaps.append(await ws.snapshot())
            assert (record_of(snaps[-1]).path / "parent").read_text() == record_of(whole).path.name
            assert _depth(snaps[-1]) == 2
            assert _pages_bytes(snaps[-1]) < _pages_bytes(whole) / 3, (_pages_bytes(snaps[-1]), _pages_bytes(whole))
        last = await _get(ws, "/digest")
        (probe,) = await Workspace.from_snapshot(whole)  # the same steps from the whole dump, in another copy
        try:
            for step in (101, 102):
                assert await _get(probe, f"/dirty/{step}/1") == "ok"
                digests.append(await _get(probe, "/digest"))
        finally:
            await probe.aclose()
        assert digests[-1] == last  # the restore in place carried the workspace's memory
        assert len(set(digests)) == len(digests)  # every step changed the memory

        for i, snap in enumerate(snaps):
            (copy,) = await Workspace.from_snapshot(snap)
            try:
                assert await _get(copy, "/digest") == digests[i], f"snapshot {i}, chain {_depth(snap)}"
            finally:
                await copy.aclose()
    finally:
        for snap in snaps:
            await snap.aclose()
