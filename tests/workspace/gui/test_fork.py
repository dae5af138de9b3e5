"""Forking a GUI workspace keeps its display: the same pixels, live applications (Tk, xterm, Mesa OpenGL) and
working input, through generations; closing it leaves no X server, socket or shared memory behind."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import anyio

from bunshin_async import Workspace

from .conftest import settled, wait_for


async def _answer(ws: Workspace) -> str:
    res = await ws.exec(["cat", "/workspace/answer.txt"])
    return res.stdout if res.exit_code == 0 else ""


async def _fill(ws: Workspace, pos: dict[str, list[int]], text: str) -> None:
    await ws.gui.click(*pos["entry"])
    await ws.gui.type_text(text)
    await ws.gui.key("Return")


async def test_fork_copies_pixels_and_each_copy_takes_its_own_input(
    form: tuple[Workspace, dict[str, list[int]]],
) -> None:
    parent, pos = form
    await parent.spawn("xterm -geometry 60x10+40+260")
    await wait_for(lambda: _has_window(parent, "xterm"))
    before = await settled(parent)
    copies = await parent.fork(3)
    try:
        # Right after the fork every copy shows exactly the parent's screen.
        for ws in copies:
            assert ws.fork_mode != "fresh"
            assert (await ws.gui.screenshot()).digest == before
            assert [w.name for w in await ws.gui.windows()] == [w.name for w in await parent.gui.windows()]
        # Different input in each copy: different answers, different screens.
        answers = [f"answer {i}" for i in range(len(copies))]
        async with anyio.create_task_group() as tg:
            for ws, text in zip(copies, answers, strict=True):
                tg.start_soon(_fill, ws, pos, text)
        for ws, text in zip(copies, answers, strict=True):
            assert await wait_for(functools.partial(_answer, ws)) == text
        digests = [await settled(ws) for ws in copies]
        assert len(set(digests)) == len(copies) and before not in digests
        # The xterm in a copy is live: it runs what is typed into it.
        await copies[0].gui.click(100, 300)
        await copies[0].gui.type_text("touch /workspace/from-xterm")
        await copies[0].gui.key("Return")
        await wait_for(lambda: _exists(copies[0], "/workspace/from-xterm"))
        # The parent saw none of it.
        assert (await parent.gui.screenshot()).digest == before
        assert await _answer(parent) == ""
        assert not await _exists(parent, "/workspace/from-xterm")
    finally:
        for ws in copies:
            await ws.aclose()


async def _has_window(ws: Workspace, name: str) -> bool:
    return any(w.name == name for w in await ws.gui.windows())


async def _exists(ws: Workspace, path: str) -> bool:
    return (await ws.exec(["test", "-e", path])).exit_code == 0


async def test_opengl_client_keeps_rendering_after_restore(gui_ws: Workspace) -> None:
    parent = gui_ws
    await parent.spawn("glxgears -geometry 200x200+0+0", log_path="/workspace/glxgears.log")
    await wait_for(lambda: _has_window(parent, "glxgears"))
    async with await parent.snapshot() as snap:
        [copy] = await Workspace.from_snapshot(snap)
    try:
        assert (await copy.exec("pgrep -x glxgears")).exit_code == 0
        seen = {(await copy.gui.screenshot()).digest}

        async def moved() -> bool:
            seen.add((await copy.gui.screenshot()).digest)
            return len(seen) >= 3

        await wait_for(moved, timeout=10)  # the gears turn: the screen keeps changing
        # Mesa software rendering (llvmpipe), not some fallback.
        assert "llvmpipe" in (await copy.exec("glxinfo -B")).stdout
    finally:
        await copy.aclose()


async def test_three_generations_of_fork_of_fork(form: tuple[Workspace, dict[str, list[int]]]) -> None:
    ws, pos = form
    lineage: list[Workspace] = []
    typed = ""
    try:
        for generation in "abc":
            await ws.gui.click(*pos["entry"])
            await ws.gui.type_text(generation)
            typed += generation
            digest = await settled(ws)
            [child] = await ws.fork(1)
            lineage.append(child)
            assert (await child.gui.screenshot()).digest == digest
            ws = child
        await ws.gui.key("Return")
        assert await wait_for(lambda: _answer(ws)) == typed
        # Every ancestor still has its own, shorter text and no answer.
        for ancestor in lineage[:-1]:
            assert await _answer(ancestor) == ""
    finally:
        for child in lineage:
            await child.aclose()


def _host_x_state() -> tuple[set[str], int, set[str]]:
    x11 = Path("/tmp/.X11-unix")
    sockets = set(os.listdir(x11)) if x11.is_dir() else set()
    with open("/proc/net/unix") as f:
        abstract = sum(1 for line in f if "X11-unix" in line)
    with open("/proc/sysvipc/shm") as f:
        shm = {line.split()[1] for line in list(f)[1:]}
    return sockets, abstract, shm


async def test_closing_leaves_no_x_server_socket_or_shared_memory() -> None:
    before = _host_x_state()
    ws = Workspace(display=True)
    await ws.start()
    try:
        await ws.spawn("glxgears -geometry 100x100+0+0")
        await ws.spawn("xterm")
        await wait_for(lambda: _has_window(ws, "glxgears"))
        # Inside: the X server's socket file and abstract socket, and the MIT-SHM segment glxgears draws through.
        # They are the workspace's own: its root, its network namespace, its IPC namespace.
        inside = await ws.exec("ls /tmp/.X11-unix; grep -c X11-unix /proc/net/unix; tail -n +2 /proc/sysvipc/shm")
        x0, sockets, *segments = inside.stdout.splitlines()
        assert x0 == "X0" and int(sockets) >= 2 and segments
        [copy] = await ws.fork(1)
        await copy.aclose()
    finally:
        await ws.aclose()
    assert _host_x_state() == before
    # Processes, mounts, cgroups and directories: the root conftest's leak check runs after this test.
