"""The GUI tools for an agent (``tools.gui_tools``): ``Tool`` specs whose handlers call ``ws.gui`` (``_gui``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._workspace._gui import Screenshot, Window
from ._tools import Effect, Tool

if TYPE_CHECKING:
    from .._workspace._facade import Workspace

__all__ = ["gui_tools"]


def _point_schema(**extra: Any) -> dict[str, Any]:
    props: dict[str, Any] = {"x": {"type": "integer"}, "y": {"type": "integer"}, **extra}
    return {"type": "object", "properties": props, "required": ["x", "y"], "additionalProperties": False}


async def _screenshot(ws: Workspace, args: dict[str, Any]) -> Screenshot:
    return await ws.gui.screenshot()


async def _windows(ws: Workspace, args: dict[str, Any]) -> list[Window]:
    return await ws.gui.windows()


async def _click(ws: Workspace, args: dict[str, Any]) -> None:
    await ws.gui.click(args["x"], args["y"], args.get("button", 1))


async def _move(ws: Workspace, args: dict[str, Any]) -> None:
    await ws.gui.move(args["x"], args["y"])


async def _scroll(ws: Workspace, args: dict[str, Any]) -> None:
    await ws.gui.scroll(args["x"], args["y"], args["dy"])


async def _type_text(ws: Workspace, args: dict[str, Any]) -> None:
    await ws.gui.type_text(args["text"])


async def _key(ws: Workspace, args: dict[str, Any]) -> None:
    await ws.gui.key(args["combo"])


def _shot_fingerprint(result: Any) -> Any:
    return result.digest if isinstance(result, Screenshot) else result


def _tool(
    name: str,
    description: str,
    schema: dict[str, Any],
    handler: Any,
    effect: Effect,
    version: str,
    **kw: Any,
) -> Tool:
    return Tool(
        name=name, description=description, schema=schema, handler=handler, effect=effect, version=version, **kw
    )


def _object(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def gui_tools(*, version: str = "1") -> list[Tool]:
    """The GUI tools for an agent: ``screenshot`` and ``windows`` are ``read`` (a screenshot is nondeterministic:
    animations and clocks change pixels without any call), the input tools are ``write``."""
    r, w = Effect.READ, Effect.WRITE
    return [
        _tool(
            "screenshot", "Capture the screen; returns a PNG and a digest of its pixels.", _object(), _screenshot,
            r, version, deterministic=False, result_type=Screenshot, fingerprint=_shot_fingerprint,
        ),
        _tool(
            "windows", "List the visible top-level windows: id, name, x, y, width, height.", _object(), _windows,
            r, version, result_type=list[Window],
        ),
        _tool(
            "click", "Click at screen pixel (x, y); button 1 left, 2 middle, 3 right.",
            _point_schema(button={"type": "integer", "default": 1}), _click, w, version, result_type=None,
        ),
        _tool("move", "Move the pointer to (x, y).", _point_schema(), _move, w, version, result_type=None),
        _tool(
            "scroll", "Scroll the wheel dy notches at (x, y); positive scrolls down.",
            {**_point_schema(dy={"type": "integer"}), "required": ["x", "y", "dy"]}, _scroll, w, version,
            result_type=None,
        ),
        _tool(
            "type_text", "Type text into the focused window (click it first).", _object(text={"type": "string"}),
            _type_text, w, version, result_type=None,
        ),
        _tool(
            "key", "Press a key or chord, e.g. 'Return', 'ctrl+a', 'shift+Tab'.", _object(combo={"type": "string"}),
            _key, w, version, result_type=None,
        ),
    ]  # fmt: skip
