"""CRIU's start is not part of the source's pause (issue 39, item 3): a dump's ``criu swrk`` is started, and has
answered a request, before the workspace is drained (``CriuBackend.call``'s ``ready``); a cancellation or a refusal
before the dump's request kills that idle CRIU and leaves the workspace running and nothing behind. The upper dir's
copy starts once CRIU has frozen the tree and runs beside its dump (``_snapstore.TreeCopy``)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from bunshin_async import Config, ForkError, Workspace
from bunshin_async._fork import _dump, _quiesce
from bunshin_async._host import _criu, _tree
from bunshin_async._host._client import AgentClient

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]


class Spawns(_criu.SwrkCriu):
    """The real backend, noting each CRIU it starts."""

    def __init__(self) -> None:
        super().__init__(on_spawn=self._spawned)
        self.pids: list[int] = []

    async def _spawned(self, pid: int) -> None:
        self.pids.append(pid)


def _snapshots() -> list[Path]:
    store = Config.current().snapshot_dir
    return sorted(p for p in store.iterdir() if not p.name.startswith(".")) if store.exists() else []


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


async def test_criu_has_started_before_the_workspace_is_drained(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = Spawns()
    seen: list[tuple[str, str]] = []
    real = _quiesce.drain

    async def drain(core: Any) -> Any:
        seen.append(("drain", _exe(backend.pids[-1]) if backend.pids else ""))
        return await real(core)

    monkeypatch.setattr(_quiesce, "drain", drain)
    await ws.write_file("/workspace/f", "kept")
    async with await _dump.snapshot(ws._core, backend) as snap:
        assert len(seen) == 1  # (a first tracked snapshot's pre-copy started a CRIU of its own before)
        # the wrapper (bunshin-init --join) has exec'd CRIU, which answered before the drain began
        assert Path(seen[0][1]).name == "criu", seen
        assert snap.dump_ms is not None and snap.dump_ms > 0
        [copy] = await Workspace.from_snapshot(snap)
        try:
            assert await copy.read_file("/workspace/f") == b"kept"
        finally:
            await copy.aclose()
    assert (await ws.exec("echo alive")).stdout == "alive\n"


async def test_a_cancellation_before_the_request_kills_the_idle_criu(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = Spawns()
    waiting = anyio.Event()

    async def drain(core: Any) -> Any:
        waiting.set()
        await anyio.sleep_forever()

    monkeypatch.setattr(_quiesce, "drain", drain)
    before = _snapshots()
    async with anyio.create_task_group() as tg:

        async def take() -> None:
            await _dump.snapshot(ws._core, backend)

        tg.start_soon(take)
        await waiting.wait()
        pid = backend.pids[-1]
        assert Path(_exe(pid)).name == "criu"
        tg.cancel_scope.cancel()
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped
    assert _snapshots() == before
    monkeypatch.undo()
    assert (await ws.exec("echo alive")).stdout == "alive\n"
    async with await ws.snapshot():  # the next dump is unaffected
        pass


async def test_a_refused_dump_kills_the_idle_criu_and_says_why_once(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = Spawns()
    monkeypatch.setattr(_dump, "_undumpable", lambda core, after: "cannot snapshot: injected (retry)")
    before = _snapshots()
    with pytest.raises(ForkError) as err:
        await _dump.snapshot(ws._core, backend)
    assert str(err.value).count("injected") == 1, err.value
    pid = backend.pids[-1]
    assert not Path(f"/proc/{pid}").exists()
    assert _snapshots() == before
    monkeypatch.undo()
    assert (await ws.exec("echo alive")).stdout == "alive\n"  # drained, then resumed


async def test_the_upper_copy_runs_beside_the_dump_once_the_tree_is_frozen(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str, bool]] = []
    real_copy = _tree.copy_tree
    view = ws.cgroup
    assert view is not None

    def copy(src: str | Path, dst: str | Path) -> int:
        if Path(src) == ws._core.dir / "upper":
            events.append(("copy", threading.current_thread().name, view.frozen))
        return real_copy(src, dst)

    class Noting(_criu.SwrkCriu):
        async def call(self, req: Any, *, notify: Any = None, **kw: Any) -> Any:
            async def noted(name: str, pid: int) -> None:
                events.append(("notify", name, False))
                if notify is not None:
                    await notify(name, pid)

            return await super().call(req, notify=noted, **kw)

    monkeypatch.setattr(_tree, "copy_tree", copy)
    await ws.write_file("/workspace/f", "kept")
    async with await _dump.snapshot(ws._core, Noting()) as snap:
        names = [e[1] for e in events]
        copied = names.index("bunshin-tree-copy")
        assert names.index("query-ext-files") < copied < names.index("post-dump"), events
        assert events[copied][2], "the tree was not frozen when its upper dir was copied"
        [copy_ws] = await Workspace.from_snapshot(snap)
        try:
            assert await copy_ws.read_file("/workspace/f") == b"kept"
        finally:
            await copy_ws.aclose()


async def test_the_workspace_goes_on_at_crius_answer_before_its_exit(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CRIU answers after the thaw; its exit and reaping (0.2-4 ms here) are not the workspace's pause: the held
    # calls go on at the answer (``_dump``'s ``thawed``), and ``dump_ms`` ends there
    events: list[str] = []
    real_reap = _criu._reap
    real_resume = AgentClient.resume

    async def reap(proc: Any, kill: bool) -> None:
        events.append("reap")
        await real_reap(proc, kill)

    def resume(self: AgentClient) -> None:
        events.append("resume")
        real_resume(self)

    monkeypatch.setattr(_criu, "_reap", reap)
    monkeypatch.setattr(AgentClient, "resume", resume)
    await ws.write_file("/workspace/f", "kept")
    events.clear()
    async with await _dump.snapshot(ws._core, Spawns()) as snap:
        assert events[-3:] == ["resume", "reap", "resume"], events  # the second: ``finally``'s, a no-op
        assert snap.dump_ms is not None and snap.dump_ms > 0
    assert (await ws.exec("echo alive")).stdout == "alive\n"


async def test_the_pause_counts_from_the_held_calls(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    # ``dump_ms`` is the pause a call sees: from the drain's start (new calls held) to CRIU's answer. The dump's
    # checks (``_before_dump``) run before the drain while no call runs; a call in flight then has them made again
    # after the drain, and that time is in the pause.
    checks: list[tuple[bool, float]] = []  # (the workspace's calls held, when the check started)
    resumed: list[float] = []
    real_check = _dump._before_dump
    real_resume = AgentClient.resume
    client = ws._core.client
    assert client is not None

    release = False  # the first check lets the call in flight end (an order: it blocks on a fifo until then)

    def check(core: Any) -> Any:
        nonlocal release
        checks.append((not client._open.is_set(), time.monotonic()))
        if release:
            release = False
            anyio.from_thread.run(ws.exec, "echo go > /tmp/go")  # before the drain: not held
        return real_check(core)

    def resume(self: AgentClient) -> None:
        resumed.append(time.monotonic())
        real_resume(self)

    monkeypatch.setattr(_dump, "_before_dump", check)
    monkeypatch.setattr(AgentClient, "resume", resume)
    await ws.write_file("/workspace/f", "kept")
    async with await _dump.snapshot(ws._core, Spawns()):
        assert [held for held, _ in checks] == [False], checks  # once, the calls not held
    checks.clear()
    resumed.clear()

    async def in_flight() -> None:
        await ws.exec("read line < /tmp/go")

    assert (await ws.exec("mkfifo /tmp/go")).ok
    release = True
    async with anyio.create_task_group() as tg:
        tg.start_soon(in_flight)
        while client.mark()[1] == 0:  # the exec is in flight
            await anyio.lowlevel.checkpoint()
        async with await _dump.snapshot(ws._core, Spawns()) as snap:
            assert [held for held, _ in checks] == [False, True], checks  # made again once the exec had ended
            assert snap.dump_ms is not None
            # the second check, and the wait for the exec before it, are in the pause the held calls saw
            assert snap.dump_ms >= (resumed[0] - checks[1][1]) * 1000, (snap.dump_ms, checks, resumed)
    assert (await ws.exec("echo alive")).stdout == "alive\n"


async def test_the_drain_looks_for_host_connections_only_after_one_closed_unseen(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hang-up sees the agent's end-of-file for each idle connection, so a dump looks through the workspace's
    # descriptors (0.3 ms) only when a connection was closed without it (here: closed without a hang-up, as a
    # rebind does); that look finds none, and the next dump does not look again.
    looks: list[int] = []
    real = _quiesce._host_connections

    def host_connections(core: Any) -> int:
        looks.append(n := real(core))
        return n

    monkeypatch.setattr(_quiesce, "_host_connections", host_connections)
    client = ws._core.client
    assert client is not None
    await ws.write_file("/workspace/f", "kept")
    async with await _dump.snapshot(ws._core, Spawns()):
        assert looks == []
    assert (await ws.exec("echo one")).stdout == "one\n"  # an idle connection again
    await client._close_idle()  # closed without a hang-up: the agent's end may still be open
    async with await _dump.snapshot(ws._core, Spawns()):
        assert looks and looks[-1] == 0, looks  # looked until the agent's end was gone
    seen = len(looks)
    assert (await ws.exec("echo two")).stdout == "two\n"
    async with await _dump.snapshot(ws._core, Spawns()) as snap:
        assert len(looks) == seen
        [copy] = await Workspace.from_snapshot(snap)
        try:
            assert await copy.read_file("/workspace/f") == b"kept"
        finally:
            await copy.aclose()


async def test_the_look_for_host_connections_is_bounded(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    # The guest decides how many descriptors its processes hold: past the bound the look stops and the snapshot
    # fails at once (the workspace goes on), where it read them all on the event loop, however many.
    monkeypatch.setattr(_quiesce, "MAX_DESCRIPTORS", 2)
    client = ws._core.client
    assert client is not None
    await ws.exec("true")  # an idle connection
    await client._close_idle()  # closed without a hang-up: the drain must look
    with pytest.raises(ForkError, match="descriptors to look through for a host connection"):
        await _dump.snapshot(ws._core, Spawns())
    assert (await ws.exec("echo alive")).stdout == "alive\n"
    monkeypatch.setattr(_quiesce, "MAX_DESCRIPTORS", 1 << 16)  # within it: the look finds none and the dump goes on
    async with await _dump.snapshot(ws._core, Spawns()):
        pass
