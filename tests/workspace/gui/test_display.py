"""The display starts with the workspace, the tools work inside it, and bad input or a missing display is a clear
error."""

from __future__ import annotations

import hashlib
import pickle
import struct
import zlib

import anyio
import pytest

from bunshin_async import Display, DisplayError, Image, InvalidArgument, Limits, Screenshot, ToolError, Workspace
from bunshin_async.tools import Effect, gui_tools

from .conftest import settled, wait_for


def _decode_png(png: bytes) -> tuple[int, int, bytes]:
    """Width, height and raw RGB pixels of an 8-bit RGB PNG whose rows use filter 0 (what the guest writes)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos : pos + 4])
        tag, body = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + n]
        if tag == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    rows = zlib.decompress(idat)
    stride = 1 + 3 * w
    assert all(rows[y * stride] == 0 for y in range(h))
    return w, h, b"".join(rows[y * stride + 1 : (y + 1) * stride] for y in range(h))


async def test_screenshot_size_digest_and_png() -> None:
    async with Workspace(display=Display(width=640, height=480, depth=24)) as ws:
        assert (await ws.exec("echo $DISPLAY")).stdout == ":0\n"
        assert ws.image.name == Image.gui().name
        shot = await ws.gui.screenshot()
        assert isinstance(shot, Screenshot) and (shot.width, shot.height) == (640, 480)
        w, h, pixels = _decode_png(shot.png)
        assert (w, h) == (640, 480) and hashlib.sha256(pixels).hexdigest() == shot.digest
        assert await ws.gui.windows() == []


async def test_depth_16_screenshot() -> None:
    async with Workspace(display=Display(width=320, height=200, depth=16)) as ws:
        await ws.spawn("xterm -geometry 20x5+10+10")
        await wait_for(ws.gui.windows)
        shot = await settled(ws)
        w, h, pixels = _decode_png((await ws.gui.screenshot()).png)
        assert (w, h) == (320, 200) and hashlib.sha256(pixels).hexdigest() == shot
        assert {pixels[i : i + 3] for i in range(0, len(pixels), 3)} >= {b"\0\0\0", b"\xff\xff\xff"}


async def test_form_input_changes_screen_and_state(form: tuple[Workspace, dict[str, list[int]]]) -> None:
    ws, pos = form
    [win] = await ws.gui.windows()
    assert (win.name, win.x, win.y, win.width, win.height) == ("bunshin form", 40, 40, 420, 160)
    before = (await ws.gui.screenshot()).digest
    await ws.gui.click(*pos["entry"])
    await ws.gui.type_text("hello Tk")
    await ws.gui.key("ctrl+a")  # Tk's entry: to the start of the line; harmless here
    await ws.gui.key("End Return")
    assert await wait_for(lambda: ws.exec("cat /workspace/answer.txt")) and (
        await ws.read_text("/workspace/answer.txt") == "hello Tk"
    )
    assert await settled(ws) != before


async def test_pointer_move_and_scroll(gui_ws: Workspace) -> None:
    ws = gui_ws
    await ws.gui.move(100, 200)
    assert (await ws.exec("xdotool getmouselocation")).stdout.startswith("x:100 y:200 ")
    await ws.gui.scroll(300, 301, 3)
    await ws.gui.scroll(300, 302, -2)
    await ws.gui.scroll(300, 303, 0)
    assert (await ws.exec("xdotool getmouselocation")).stdout.startswith("x:300 y:303 ")
    await ws.gui.click(5, 5, button=3)


async def test_bad_input_is_invalid_argument(gui_ws: Workspace) -> None:
    gui = gui_ws.gui
    for x, y in [(-1, 0), (0, -1), (1024, 0), (0, 768), (5000, 5000)]:
        with pytest.raises(InvalidArgument, match="off the 1024x768 screen"):
            await gui.click(x, y)
    with pytest.raises(InvalidArgument):
        await gui.move(1024, 10)
    with pytest.raises(InvalidArgument):
        await gui.scroll(10, 768, 1)
    with pytest.raises(InvalidArgument, match="button"):
        await gui.click(1, 1, button=0)
    with pytest.raises(InvalidArgument, match="No such key name 'NoSuchKey'"):
        await gui.key("NoSuchKey")
    with pytest.raises(InvalidArgument, match="nosuch"):
        await gui.key("ctrl+nosuch")
    with pytest.raises(InvalidArgument):
        await gui.key("  ")
    with pytest.raises(InvalidArgument):
        await gui.click(1.5, 2)  # type: ignore[arg-type]
    await gui.key("ctrl+a")  # still fine afterwards


async def test_no_display_is_display_error() -> None:
    async with Workspace() as ws:
        with pytest.raises(DisplayError, match="no display") as info:
            await ws.gui.screenshot()
        assert info.value.workspace_id == ws.id
        with pytest.raises(DisplayError):
            await ws.gui.click(1, 1)


async def test_dead_x_server_is_display_error(gui_ws: Workspace) -> None:
    ws = gui_ws
    await ws.exec("pkill -x Xvfb")
    await wait_for(lambda: _gone(ws))
    with pytest.raises(DisplayError, match="not running"):
        await ws.gui.screenshot()
    with pytest.raises(DisplayError, match="not running"):
        await ws.gui.key("Return")
    with pytest.raises(DisplayError):
        await ws.gui.windows()


FAKES = {
    # what a workspace's own python3 (the screenshot and window helpers) or xdotool (the screen size) may print
    "python3": [
        '{"width": "wide", "height": 1, "digest": "x"}\nAAAA',
        '{"width": 1}\nAAAA',
        "not json",
        '[{"id": "x"}]',
    ],
    "xdotool": ["wide tall", "640", ""],
}


async def test_hostile_helper_output_is_a_tool_error(gui_ws: Workspace) -> None:
    """The GUI tools parse what programs inside the workspace print: a shape the host does not expect is a
    ``ToolError``, never a ``KeyError``/``ValueError`` of the host, and the tools work again once they are back."""
    ws = gui_ws
    for program, outputs in FAKES.items():
        for out in outputs:
            fake = f"#!/bin/sh\nprintf '%s' '{out}'\n"
            assert (
                await ws.exec(
                    ["sh", "-c", f"cat > /usr/local/bin/{program}; chmod 755 /usr/local/bin/{program}"],
                    stdin=fake.encode(),
                )
            ).ok
            calls = [ws.gui.screenshot, ws.gui.windows] if program == "python3" else [ws.gui.size]
            for call in calls:
                with pytest.raises(ToolError, match="unreadable output|helper failed"):
                    await call()
        await ws.exec(["rm", f"/usr/local/bin/{program}"])
    shot = await ws.gui.screenshot()
    assert (shot.width, shot.height) == await ws.gui.size()
    assert isinstance(await ws.gui.windows(), list)


async def _gone(ws: Workspace) -> bool:
    return (await ws.exec("pgrep -x Xvfb")).exit_code != 0


async def test_display_that_cannot_start_is_display_error_and_leaves_nothing() -> None:
    ws = Workspace(Image.base(), display=True)  # the base image has no X server
    with pytest.raises(DisplayError, match="lacks Xvfb and xdotool") as info:
        await ws.start()
    assert ws.closed and info.value.workspace_id == ws.id


async def test_x_server_that_exits_is_display_error() -> None:
    # A real failure: an 8192x8192 framebuffer (256 MiB) does not fit the workspace's 96 MiB memory limit, so the
    # kernel's OOM killer ends Xvfb while it starts.
    ws = Workspace(display=Display(width=8192, height=8192), limits=Limits(memory=96 << 20))
    with pytest.raises(DisplayError, match="exited with status") as info:
        await ws.start()
    assert ws.closed and info.value.workspace_id == ws.id


def test_display_validation_and_tool_effects() -> None:
    err = pickle.loads(pickle.dumps(DisplayError("no X", workspace_id="abc", detail="log")))
    assert isinstance(err, DisplayError) and (err.workspace_id, err.detail, str(err)) == ("abc", "log", "no X")
    assert Display() == Display(1024, 768, 24)
    for bad in [{"width": 0}, {"height": 10**6}, {"depth": 32}, {"width": True}]:
        with pytest.raises(ValueError):
            Display(**bad)  # type: ignore[arg-type]
    tools = {t.name: t for t in gui_tools()}
    assert {n for n, t in tools.items() if t.effect is Effect.READ} == {"screenshot", "windows"}
    assert {n for n, t in tools.items() if t.effect is Effect.WRITE} == {"click", "move", "scroll", "type_text", "key"}
    assert not tools["screenshot"].classify_call({}).cacheable
    assert tools["click"].normalize({"x": 1, "y": 2}) == {"x": 1, "y": 2, "button": 1}
    with pytest.raises(InvalidArgument):
        tools["key"].normalize({})


async def test_tool_handlers_run_against_the_workspace(gui_ws: Workspace) -> None:
    tools = {t.name: t for t in gui_tools()}
    assert tools["move"].handler is not None and tools["screenshot"].handler is not None
    await tools["move"].handler(gui_ws, tools["move"].normalize({"x": 7, "y": 9}))
    shot = await tools["screenshot"].handler(gui_ws, {})
    assert tools["screenshot"].fingerprint(shot) == shot.digest
    with anyio.fail_after(5):
        assert (await gui_ws.exec("xdotool getmouselocation")).stdout.startswith("x:7 y:9 ")
