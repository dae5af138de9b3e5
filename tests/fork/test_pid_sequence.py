"""A copy continues its source's pid sequence (criu/patches/0021): the next process started in a copy gets the pid
the source's next process gets, in a fork, a fork of a fork, a copy made from a snapshot, a warm spare and a
rollback. CRIU gives each restored task its old pid with clone3's set_tid, which leaves the namespace's cursor
behind; before 0021 a copy's next process got the lowest free pid (the experiment's oracle runs printed another pid
for `nohup ... & echo PID: $!` in a fork than on the main line). The dump's value is kept in a file among the
snapshot's images, which the restore treats as untrusted: garbage there is ignored, the copy works. Run in both
restore modes (``criu-cow``, ``criu-ksm``) and with write-tracked dumps."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from bunshin_async import Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import criu_features
from bunshin_async._host._pidns import LAST_PID_IMG, LastPid, parse_exchange, parse_last_pid

pytestmark = pytest.mark.tracked

LAST_PID = "last-pid"  # the feature criu/patches/0021 adds to `criu --version`


@pytest.fixture(autouse=True)
def _patched() -> None:
    assert LAST_PID in criu_features(), "CRIU lacks criu/patches/0021: run criu/build.sh"


async def _next_pid(ws: Workspace) -> int:
    """The pid the workspace's next process gets (that process's own, ``$$``)."""
    return int((await ws.exec("sh -c 'echo $$'")).stdout)


async def _gapped(ws: Workspace) -> None:
    """Leave the lowest free pids far below the namespace's last one: processes that ran and exited, and one that
    keeps running above them, so that "the lowest free pid" and "the one after the last" differ."""
    await ws.exec("for i in 1 2 3 4 5 6 7 8 9 10; do sh -c true; done")
    await ws.spawn("sleep 1000")


async def test_copies_and_their_copies_get_the_pid_their_source_gets(ws: Workspace) -> None:
    await _gapped(ws)
    copies = await ws.fork(2)
    try:
        pids = [await _next_pid(w) for w in (ws, *copies)]
        assert pids == [pids[0]] * 3, pids
        (grandchild,) = await copies[1].fork()  # a copy's dump carries the value the copy has now
        try:
            # one exec later, and no more: the dump's closed connections cost the agent no new thread (issue #38)
            assert await _next_pid(grandchild) == await _next_pid(copies[1]) == pids[0] + 1
        finally:
            await grandchild.aclose()
        assert await _next_pid(copies[0]) == await _next_pid(ws)  # the other copy never saw the grandchild
    finally:
        for c in copies:
            await c.aclose()


async def test_a_snapshots_copies_and_rollbacks_continue_where_the_snapshot_was_taken(ws: Workspace) -> None:
    await _gapped(ws)
    async with await ws.snapshot() as snap:
        want = await _next_pid(ws)
        await ws.exec("for i in 1 2 3 4 5; do sh -c true; done")  # the source moves on
        (copy,) = await Workspace.from_snapshot(snap)
        try:
            assert await _next_pid(copy) == want
        finally:
            await copy.aclose()
        await ws.rollback(snap)
        assert await _next_pid(ws) == want
        await ws.rollback(snap)  # a second rollback to the same snapshot
        assert await _next_pid(ws) == want


async def test_a_warm_spare_gets_the_pid_its_snapshots_source_got(ws: Workspace) -> None:
    """A spare is restored ahead and kept frozen: handed out, it continues where the snapshot was taken."""
    await _gapped(ws)
    async with await ws.snapshot() as snap, snap.keep_spares(1) as pool:
        await pool.wait_ready(1)
        want = await _next_pid(ws)
        (copy,) = await Workspace.from_snapshot(snap)
        try:
            assert await _next_pid(copy) == want
        finally:
            await copy.aclose()


@pytest.mark.fork_modes("criu-cow")
@pytest.mark.parametrize(
    "garbage", [b"", b"abc\n", b"-5\n", b"0\n", b"99999999999999999999\n", b"12 34\n", b"\x00" * 64]
)
async def test_garbage_in_the_snapshots_last_pid_is_ignored(ws: Workspace, garbage: bytes) -> None:
    """The file is the images' (untrusted): a value that is no pid below pid_max is ignored with a warning and the
    copy works, with the pids a restore gives without it."""
    await _gapped(ws)
    async with await ws.snapshot() as snap:
        path = record_of(snap).images / LAST_PID_IMG
        assert int(path.read_text()) > 10  # the dump wrote it (the gapped workspace's last pid)
        path.write_bytes(garbage)
        (copy,) = await Workspace.from_snapshot(snap)
        try:
            assert (await copy.exec("echo ok")).stdout == "ok\n"
            assert f"Ignoring {LAST_PID_IMG}" in (copy.directory / "restore.log").read_text()
        finally:
            await copy.aclose()


@pytest.mark.unit
def test_the_helpers_answer_is_a_pid_below_pid_max_or_nothing() -> None:
    """What the helper prints comes from a namespace the workspace may have set: only ``L <pid>`` in (0, limit)."""
    assert parse_last_pid(b"L 4\n", 32768) == 4
    assert parse_last_pid(b"L 32767\n", 32768) == 32767
    for out in (b"L -1\n", b"L 0\n", b"L 32768\n", b"L 99999999999999\n", b"L 4 5\n", b"L x\n", b"E setns: EPERM\n",
                b"", b"4\n", b"L " + b"9" * 300):  # fmt: skip
        assert parse_last_pid(out, 32768) is None, out
    # a compare-and-set's answer: the pid it read, written or not (``L 4 W`` read as no pid hid what it read)
    assert parse_exchange(b"L 4 W\n", 32768) == (4, True)
    assert parse_exchange(b"L 4\n", 32768) == (4, False)
    assert parse_exchange(b"L 32768 W\n", 32768) == (None, True)
    assert parse_exchange(b"L W\n", 32768) == (None, True)


async def test_a_reading_never_asked_for_leaves_nothing(ws: Workspace, tmp_path: Path) -> None:
    """A dump that fails before the freeze lets its helper go: it exits without reading and nothing is written; a
    reading of a pid that is gone is nothing either (logged)."""
    await _gapped(ws)
    pid1 = ws._core.pid
    assert pid1 is not None
    unasked = LastPid(pid1, tmp_path)
    unasked.start()
    await unasked.join()
    assert unasked.value is None and not (tmp_path / LAST_PID_IMG).exists()
    asked = LastPid(pid1, tmp_path)
    asked.start()
    asked.ask()
    value = await asked.finish()
    assert value == int((tmp_path / LAST_PID_IMG).read_text())
    assert 10 < value < await _next_pid(ws) <= value + 2  # the gapped workspace's; the next exec's shell after it
    gone = LastPid(2**22 + 1, tmp_path / "none")
    assert await gone.finish() is None


async def test_a_finished_helper_is_joined_without_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a dump's post-dump (the tree frozen) the helper asked at query-ext-files has usually finished: ``finish``
    then costs no worker thread round trip; one still running is waited for in a worker (the loop is never
    blocked), as ``TreeCopy.join`` does."""
    hops: list[object] = []
    real = anyio.to_thread.run_sync

    async def counted(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(func)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    done = LastPid(1, tmp_path)
    monkeypatch.setattr(done, "_run", lambda: None)  # a helper that has answered
    done.start()
    assert done._thread is not None
    done._thread.join()
    await done.finish()
    assert hops == []

    release = threading.Event()
    slow = LastPid(1, tmp_path)
    monkeypatch.setattr(slow, "_run", release.wait)  # a helper still reading when finish is awaited
    slow.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(slow.finish)
        while not hops:  # finish went to a worker thread: this loop still runs
            await anyio.lowlevel.checkpoint()
        release.set()
    assert len(hops) == 1


async def _background_pid(ws: Workspace) -> int:
    """The pid a background process gets (``$!``), as the experiment's ``nohup ... & echo PID: $!`` prints it."""
    return int((await ws.exec("sleep 100 >/dev/null 2>&1 & echo $!")).stdout)


async def test_a_lines_pids_do_not_depend_on_the_snapshots_it_went_through(ws: Workspace) -> None:
    """Issue #38: the same calls give the same pids whether or not their line was snapshotted, rolled back or
    forked in between. Each dump closes the host's connections to the agent (``AgentClient.quiesce``) and the next
    call opens a new one; an agent that made a thread per connection took a pid from the workspace's namespace for
    it, one per dump in the line's history. Its connection threads are made once, before any workspace process."""
    await _gapped(ws)
    async with await ws.snapshot() as base:
        plain, snapped = await Workspace.from_snapshot(base, 2)
        try:
            for cmd in ("echo a > a", "cat a; echo b > b", "sh -c 'cat a b' | wc -c"):
                assert (await plain.exec(cmd)).stdout == (await snapped.exec(cmd)).stdout
                async with await snapped.snapshot() as snap:  # a snapshot, a rollback to it and a fork of the line
                    await snapped.rollback(snap)
                    (copy,) = await snapped.fork()
                    await copy.aclose()
            assert await _background_pid(snapped) == await _background_pid(plain)
            (copy,) = await snapped.fork()
            try:
                want = await _background_pid(plain)
                assert await _background_pid(copy) == want
                assert await _background_pid(snapped) == want
            finally:
                await copy.aclose()
        finally:
            await plain.aclose()
            await snapped.aclose()
