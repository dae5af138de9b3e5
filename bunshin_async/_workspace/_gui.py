"""GUI workspaces: a virtual X display inside the workspace (started by ``Workspace.start``) and ``Gui``, what looks
at it and drives it (``ws.gui``, over the workspace core; the agent's tools over it are in ``_gui_tools``).

``Workspace(display=True)`` starts Xvfb as a background process of the workspace (so it lives in the workspace's
namespaces and cgroup, is dumped and restored with the rest of the tree by a fork, and dies with the workspace) and
sets ``DISPLAY=:0`` for every later command. The X server listens on ``/tmp/.X11-unix/X0`` of the workspace's own
root and on the abstract socket of its own network namespace, so nothing of it is visible on the host.

Every tool runs *inside* the workspace, through the agent: input goes through xdotool (XTEST), screenshots and the
window list through a short python-xlib program. The host never connects to the display. A screenshot's ``digest``
is the sha256 of its raw RGB pixels, so two screens (a parent and its fork, two copies after different input) can
be compared exactly without decoding the PNG.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator

import msgspec

from .._exceptions import DisplayError, FileNotFound, InvalidArgument, InvalidValue, ToolError
from .._host import _protocol as P
from .._host._protocol import ExecResult
from ._core import WorkspaceCore

__all__ = ["DISPLAY", "Display", "Gui", "Screenshot", "Window"]

DISPLAY = ":0"
XVFB_LOG = "/tmp/.bunshin-xvfb.log"
START_TIMEOUT = 15.0
TOOL_TIMEOUT = 30.0
SCREENSHOT_MAX_OUTPUT = 64 << 20  # base64 of a PNG of up to 8192x8192 noisy pixels fits
DEPTHS = (16, 24)
MAX_SIDE = 8192


class Display(msgspec.Struct, frozen=True):
    """A virtual screen: ``width`` x ``height`` pixels at ``depth`` bits per pixel (16 or 24)."""

    width: int = 1024
    height: int = 768
    depth: int = 24

    def __post_init__(self) -> None:
        for side in (self.width, self.height):
            if isinstance(side, bool) or not isinstance(side, int) or not 16 <= side <= MAX_SIDE:
                raise InvalidValue(
                    f"display width and height must be integers in 16..{MAX_SIDE}, not {side!r}", argument="width"
                )
        if self.depth not in DEPTHS:
            raise InvalidValue(f"display depth must be one of {DEPTHS}, not {self.depth!r}", argument="depth")


class Screenshot(msgspec.Struct, frozen=True):
    """The whole screen: a PNG (8-bit RGB), its size in pixels, and ``digest``, the hex sha256 of the raw RGB
    pixels (row-major, 3 bytes a pixel), equal for two screens exactly when every pixel is."""

    png: bytes
    width: int
    height: int
    digest: str


class _ShotHeader(msgspec.Struct, frozen=True):
    width: int
    height: int
    digest: str


@contextlib.contextmanager
def _unreadable(tool: str, out: str) -> Iterator[None]:
    """What the helpers print comes from inside the workspace (whatever runs there as ``python3`` or ``xdotool``):
    output of the wrong shape is a ``ToolError``, not a ``KeyError`` or ``ValueError`` of the host."""
    try:
        yield
    except (ValueError, msgspec.DecodeError) as exc:  # binascii.Error and JSON errors are ValueErrors
        raise ToolError(f"{tool}: unreadable output from the workspace ({exc}): {out[:200]!r}", tool=tool) from exc


class Window(msgspec.Struct, frozen=True):
    """A mapped top-level window: X id, name (``_NET_WM_NAME`` or ``WM_NAME``, ``""`` if none), and geometry in
    screen pixels (``x``, ``y`` of its top-left corner)."""

    id: int
    name: str
    x: int
    y: int
    width: int
    height: int


# Runs in the workspace's python3 (python3-xlib is in the GUI image). Exit 3: the display cannot be opened.
_HELPER = r"""
import base64, hashlib, json, struct, sys, zlib
from Xlib import X, display, error
try:
    d = display.Display()
except error.DisplayError as exc:
    print(exc, file=sys.stderr); sys.exit(3)
scr = d.screen(); root = scr.root
op = sys.argv[1]
if op == "shot":
    w, h, depth = scr.width_in_pixels, scr.height_in_pixels, scr.root_depth
    raw = root.get_image(0, 0, w, h, X.ZPixmap, 0xFFFFFFFF).data
    bpp = next(f.bits_per_pixel for f in d.display.info.pixmap_formats if f.depth == depth)
    if bpp == 32:  # depth 24: B, G, R, pad in memory (little-endian server)
        rgb = bytearray(w * h * 3)
        rgb[0::3] = raw[2::4]; rgb[1::3] = raw[1::4]; rgb[2::3] = raw[0::4]
    elif bpp == 16:  # depth 16: RGB 565; scanlines padded to 32 bits
        stride = (w * 2 + 3) & ~3
        px = [v for y in range(h) for v in struct.unpack_from("<%dH" % w, raw, y * stride)]
        rgb = bytearray(w * h * 3)
        rgb[0::3] = bytes(((p >> 11) & 31) * 255 // 31 for p in px)
        rgb[1::3] = bytes(((p >> 5) & 63) * 255 // 63 for p in px)
        rgb[2::3] = bytes((p & 31) * 255 // 31 for p in px)
    else:
        print("unsupported pixel format: %d bits per pixel" % bpp, file=sys.stderr); sys.exit(2)
    row = w * 3
    data = b"".join(b"\0" + rgb[i:i + row] for i in range(0, len(rgb), row))
    def chunk(tag, body):
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(data, 6)) + chunk(b"IEND", b""))
    print(json.dumps({"width": w, "height": h, "digest": hashlib.sha256(rgb).hexdigest()}))
    sys.stdout.write(base64.b64encode(png).decode())
elif op == "windows":
    NET_WM_NAME, UTF8 = d.intern_atom("_NET_WM_NAME"), d.intern_atom("UTF8_STRING")
    out = []
    for win in root.query_tree().children:
        try:
            if win.get_attributes().map_state != X.IsViewable:
                continue
            g = win.get_geometry()
            pos = win.translate_coords(root, 0, 0)
            prop = win.get_full_property(NET_WM_NAME, UTF8)
            name = prop.value.decode("utf-8", "replace") if prop is not None else (win.get_wm_name() or "")
            if isinstance(name, bytes):
                name = name.decode("latin-1")
            out.append({"id": win.id, "name": name, "x": -pos.x, "y": -pos.y, "width": g.width, "height": g.height})
        except error.XError:
            continue  # the window went away while we looked
    print(json.dumps(out))
"""


class Gui:
    """The GUI tools of one workspace (``ws.gui``). Coordinates are screen pixels from the top-left corner;
    anything off screen raises ``InvalidArgument``. A workspace without a running display raises
    ``DisplayError``. Each call runs to completion inside the workspace before it returns, so input is delivered
    to the X server (not necessarily handled by the application yet) when the call returns."""

    def __init__(self, core: WorkspaceCore) -> None:
        self._core = core
        self._size: tuple[int, int] | None = None

    # ------------------------------------------------------------------------------------------------ plumbing

    def _env(self, tool: str) -> dict[str, str]:
        env = self._core.spec.env
        display = env.get("DISPLAY")
        if display is None:
            raise DisplayError(
                f"workspace {self._core.id} has no display ({tool}); create it with Workspace(display=True)",
                workspace_id=self._core.id,
            )
        return {**env, "DISPLAY": display}

    async def _run(self, argv: list[str], tool: str, max_output: int = P.DEFAULT_MAX_OUTPUT) -> ExecResult:
        req = P.Exec(argv=argv, env=self._env(tool), timeout=TOOL_TIMEOUT, max_output=max_output)
        try:
            resp = await self._core.call(req, tool, TOOL_TIMEOUT)
        except FileNotFound as exc:
            raise DisplayError(
                f"workspace {self._core.id}: {exc} ({tool}); the GUI tools need the GUI image (`Image.gui()`)",
                workspace_id=self._core.id,
            ) from exc
        assert isinstance(resp, ExecResult)
        return resp

    def _not_running(self, tool: str, stderr: str) -> DisplayError:
        return DisplayError(
            f"workspace {self._core.id}: the display is not running ({tool}): {stderr.strip()[-300:]}",
            workspace_id=self._core.id,
            detail=stderr,
        )

    async def _xdotool(self, tool: str, *args: str) -> str:
        res = await self._run(["xdotool", *args], tool)
        # xdotool reports a bad key name on stderr ("(symbol) No such key name 'X'. Ignoring it.") and still
        # exits 0 (xdo.c, _xdo_send_keysequence_window_to_keycode_list), so stderr is checked too.
        if "Can't open display" in res.stderr:
            raise self._not_running(tool, res.stderr)
        if res.exit_code != 0 or "No such key name" in res.stderr:
            raise InvalidArgument(f"{tool}: {res.stderr.strip() or f'xdotool exited {res.exit_code}'}", tool=tool)
        return res.stdout

    async def _helper(self, op: str, tool: str, max_output: int = P.DEFAULT_MAX_OUTPUT) -> str:
        res = await self._run(["python3", "-c", _HELPER, op], tool, max_output)
        if res.exit_code == 3:
            raise self._not_running(tool, res.stderr)
        if res.exit_code != 0 or res.truncated:
            raise ToolError(f"{tool}: helper failed ({res.exit_code}): {res.stderr.strip()[-500:]}", tool=tool)
        return res.stdout

    async def size(self) -> tuple[int, int]:
        """The screen's width and height in pixels (asked once, then remembered: a screen does not resize)."""
        if self._size is None:
            out = await self._xdotool("size", "getdisplaygeometry")
            with _unreadable("size", out):
                width, height = map(int, out.split())
                self._size = (width, height)
        return self._size

    async def _point(self, x: int, y: int, tool: str) -> tuple[str, str]:
        for v in (x, y):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidArgument(f"{tool}: coordinates must be integers, not {v!r}", tool=tool)
        w, h = await self.size()
        if not (0 <= x < w and 0 <= y < h):
            raise InvalidArgument(f"{tool}: ({x}, {y}) is off the {w}x{h} screen", tool=tool)
        return str(x), str(y)

    # ------------------------------------------------------------------------------------------------ tools

    async def screenshot(self) -> Screenshot:
        """The whole screen as a PNG, with a digest of its raw pixels."""
        out = await self._helper("shot", "screenshot", SCREENSHOT_MAX_OUTPUT)
        header, _, b64 = out.partition("\n")
        with _unreadable("screenshot", out):
            meta = msgspec.json.decode(header.encode(), type=_ShotHeader)
            png = base64.b64decode(b64, validate=True)
        self._size = (meta.width, meta.height)
        return Screenshot(png=png, width=meta.width, height=meta.height, digest=meta.digest)

    async def windows(self) -> list[Window]:
        """The mapped top-level windows, bottom to top in stacking order."""
        out = await self._helper("windows", "windows")
        with _unreadable("windows", out):
            return msgspec.json.decode(out.encode(), type=list[Window])

    async def move(self, x: int, y: int) -> None:
        """Move the pointer to (x, y)."""
        await self._xdotool("move", "mousemove", *await self._point(x, y, "move"))

    async def click(self, x: int, y: int, button: int = 1) -> None:
        """Move the pointer to (x, y) and press and release ``button`` (1 left, 2 middle, 3 right)."""
        if isinstance(button, bool) or not isinstance(button, int) or not 1 <= button <= 9:
            raise InvalidArgument(f"click: button must be an integer in 1..9, not {button!r}", tool="click")
        await self._xdotool("click", "mousemove", *await self._point(x, y, "click"), "click", str(button))

    async def scroll(self, x: int, y: int, dy: int) -> None:
        """Scroll the wheel ``dy`` notches at (x, y): positive scrolls down (X button 5), negative up (4)."""
        if isinstance(dy, bool) or not isinstance(dy, int):
            raise InvalidArgument(f"scroll: dy must be an integer, not {dy!r}", tool="scroll")
        px, py = await self._point(x, y, "scroll")
        if dy == 0:
            await self._xdotool("scroll", "mousemove", px, py)
            return
        button = "5" if dy > 0 else "4"
        await self._xdotool("scroll", "mousemove", px, py, "click", "--repeat", str(abs(dy)), "--delay", "1", button)

    async def type_text(self, text: str) -> None:
        """Type ``text`` into the window that has the keyboard focus (click it first)."""
        if not isinstance(text, str) or "\0" in text:
            raise InvalidArgument(f"type_text: text must be a string without NUL, not {text!r}", tool="type_text")
        if text:
            await self._xdotool("type_text", "type", "--delay", "2", "--", text)

    async def key(self, combo: str) -> None:
        """Press a key or a chord, xdotool style: ``"Return"``, ``"ctrl+a"``, ``"shift+Tab"``; several separated
        by spaces are pressed in turn. Unknown key names raise ``InvalidArgument``."""
        if not isinstance(combo, str) or not combo.strip() or "\0" in combo:
            raise InvalidArgument(f"key: expected a key name such as 'Return' or 'ctrl+a', not {combo!r}", tool="key")
        await self._xdotool("key", "key", "--", *combo.split())
