"""``ForkStateProvider``: write hits served by restoring a live fork, processes and memory included."""

from __future__ import annotations

import stat
from typing import Any

import pytest

from bunshin_async import Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host import _tree
from bunshin_async._rollout._state import workspace_state
from bunshin_async.cache import ForkStateProvider, ToolCache
from bunshin_async.tools import builtin_tools

from .test_session import snapshots_on_disk, sources

pytestmark = pytest.mark.usefixtures("need_workspaces")

# A process that holds a number in memory only; SIGUSR1 increments it and writes it to `value`.
HOLDER = """
import os, signal
state = {"n": 41}
def bump(*_):
    state["n"] += 1
    with open("value.tmp", "w") as f:
        f.write(str(state["n"]))
    os.replace("value.tmp", "value")
signal.signal(signal.SIGUSR1, bump)
open("ready", "w").close()
while True:
    signal.pause()
"""
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("write_file", {"path": "holder.py", "content": HOLDER}),
    ("bash", {"command": "python3 holder.py >/dev/null 2>&1 & until [ -e ready ]; do sleep 0.01; done; "
                         "echo outside > /tmp/outside"}),
    ("bash", {"command": "pkill -USR1 -f '[h]older.py'; until [ -e value ]; do sleep 0.01; done; cat value"}),
]  # fmt: skip


async def state_with_memory(ws: Workspace) -> tuple[str, str, str]:
    """Files and processes, a file outside the workspace directory, and the holder's number after one more bump
    (read from its memory: the file still says 42)."""
    state = await workspace_state(ws)
    outside = (await ws.exec("cat /tmp/outside")).stdout
    bumped = await ws.exec("rm value; pkill -USR1 -f '[h]older.py'; until [ -e value ]; do sleep 0.01; done; cat value")
    return state, outside, bumped.stdout


async def test_a_write_hit_leaves_the_state_executing_leaves() -> None:
    tools = {t.name: t for t in builtin_tools()}
    async with ToolCache(provider=ForkStateProvider()) as cache:
        async with Workspace() as ws, cache.session(ws) as sibling:
            executed_results = [await sibling.call(name, args) for name, args in CALLS]
        # The sibling's workspace is gone: the snapshots alone carry its states.
        async with Workspace() as ws, cache.session(ws) as session:
            served_results = [await session.call(name, args) for name, args in CALLS]
            assert sources(session) == ["restored"] * 3 and session.workspace is not ws
            served = await state_with_memory(session.workspace)
    async with Workspace() as ws:
        for name, args in CALLS:
            handler = tools[name].handler
            assert handler is not None
            await handler(ws, tools[name].normalize(args))
        executed = await state_with_memory(ws)
    assert served_results == executed_results
    assert served == executed
    assert "python3 holder.py" in served[0] and served[1] == "outside\n" and served[2] == "43"


async def test_snapshots_beyond_the_budget_are_evicted_unless_pinned() -> None:
    provider = ForkStateProvider()
    before = snapshots_on_disk()
    x, y = {"path": "x", "content": "1"}, {"path": "y", "content": "2"}
    async with ToolCache(provider=provider, snapshot_budget=1) as cache, Workspace() as ws1, Workspace() as ws2:
        async with cache.session(ws1) as a:
            await a.call("write_file", x)
            assert len(provider) == 1  # over budget, but a stands on that state
            await a.call("write_file", y)
            assert len(provider) == 1 and cache.metrics().snapshots_evicted == 1  # x's went when a moved on
            async with cache.session(ws2) as b:
                await b.call("write_file", x)  # its entry went with its snapshot: it runs (and captures again)
                assert len(provider) == 2  # a stands on y, b on x
                await b.call("write_file", y)  # restored from a's snapshot
                assert sources(b) == ["executed", "restored"]
                assert len(provider) == 1  # nobody stands on x any more
                assert len(snapshots_on_disk() - before) == 1
                assert await b.call("read_file", {"path": "x"}) == "1"
    assert len(provider) == 0 and snapshots_on_disk() == before


async def test_who_closes_which_workspace() -> None:
    write = {"command": "echo v > f"}
    async with ToolCache(provider=ForkStateProvider()) as cache:
        async with Workspace() as ws, cache.session(ws) as a:
            await a.call("bash", write)
        # own=False (default): the caller's workspace stays open when a restore replaces it.
        async with Workspace() as ws:
            async with cache.session(ws) as s:
                await s.call("bash", write)
                fork = s.workspace
            assert not ws.closed and fork.closed
        # own=True: the session closes the one it was given when replaced; detach() hands the current one over.
        given = Workspace()
        await given.start()
        s = cache.session(given, own=True)
        await s.call("bash", write)
        assert given.closed and s.workspace.fork_mode != "fresh"
        live = s.detach()
        await s.aclose()
        assert not live.closed and (await live.read_file("f")) == b"v\n"
        await live.aclose()


async def test_a_captures_size_is_what_its_snapshot_holds_without_a_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """``capture`` sizes the snapshot from the copy's own tally and CRIU's flat image directory: it walks no tree of
    the workspace's (one of 100k files took seconds), and the figure is what the directory holds, each inode once."""
    provider = ForkStateProvider()
    async with Workspace() as ws:
        await ws.exec(
            "mkdir -p d/e && head -c 300000 /dev/urandom > d/e/f && ln d/e/f hard && ln -s /etc/passwd link "
            "&& truncate -s 1G sparse && echo x >> sparse"
        )

        def no_walk(path: Any) -> Any:
            raise AssertionError(f"capture walked {path}")

        with monkeypatch.context() as m:
            m.setattr(_tree, "walk", no_walk)
            ref = await provider.capture(ws)
        try:
            snap = record_of(provider._snaps[ref.id])
            walked = [e.st for e in _tree.walk(snap.path) if not stat.S_ISDIR(e.st.st_mode)]
            held = {(st.st_dev, st.st_ino): st.st_blocks * 512 for st in walked}
            assert ref.size == sum(held.values())
            assert 300_000 < snap.upper_bytes < 400_000  # the hard link once, the sparse file's hole not at all
        finally:
            await provider.discard(ref)
