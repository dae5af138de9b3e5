"""GUI tests run real Xvfb in real workspaces (the GUI image, built by ``make setup``) and real CRIU; nothing is
mocked. The root conftest checks that no process, mount, cgroup or directory is left after each test."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from bunshin_async import Workspace

HERE = Path(__file__).parent


async def wait_for(check: Callable[[], Awaitable[Any]], timeout: float = 15.0) -> Any:
    """Poll ``check`` until it returns something truthy (GUI programs draw asynchronously)."""
    with anyio.fail_after(timeout):
        while not (result := await check()):
            await anyio.sleep(0.05)
    return result


async def start_form(ws: Workspace) -> dict[str, list[int]]:
    """Start the Tk form in ``ws``; return the screen coordinates of its entry and button."""
    await ws.write_file("/workspace/form_app.py", (HERE / "form_app.py").read_bytes())
    await ws.spawn(["python3", "/workspace/form_app.py"], log_path="/workspace/form.log")

    async def ready() -> Any:
        res = await ws.exec(["cat", "/workspace/ready.json"])
        return json.loads(res.stdout) if res.exit_code == 0 else None

    positions: dict[str, list[int]] = await wait_for(ready)
    await settled(ws)
    return positions


async def settled(ws: Workspace) -> str:
    """The screen's digest once two screenshots in a row agree (the application finished drawing)."""
    last = ""

    async def same() -> str | None:
        nonlocal last
        digest = (await ws.gui.screenshot()).digest
        same, last = digest == last, digest
        return digest if same else None

    return str(await wait_for(same))


@pytest.fixture
async def gui_ws() -> AsyncIterator[Workspace]:
    async with Workspace(display=True) as ws:
        yield ws


@pytest.fixture
async def form(gui_ws: Workspace) -> tuple[Workspace, dict[str, list[int]]]:
    return gui_ws, await start_form(gui_ws)
