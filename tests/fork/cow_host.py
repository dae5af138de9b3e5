"""The host side of ``cow_guest.py``: start it in a workspace and ask its HTTP server (shared by the CoW tests)."""

from __future__ import annotations

from pathlib import Path

import anyio

from bunshin_async import Workspace

GUEST = Path(__file__).parent / "cow_guest.py"


async def start(ws: Workspace, mib: int) -> None:
    await ws.write_file("/workspace/cow_guest.py", GUEST.read_bytes())
    await ws.spawn(["python3", "/workspace/cow_guest.py", str(mib)], log_path="/workspace/cow.log")
    with anyio.fail_after(120):
        while (await ws.exec("cat /workspace/cow.ready 2>/dev/null")).exit_code:  # noqa: ASYNC110 - polls the guest
            await anyio.sleep(0.05)


async def get(ws: Workspace, path: str) -> str:
    code = f"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8081{path}').read().decode())"
    r = await ws.exec(["python3", "-c", code], timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()
