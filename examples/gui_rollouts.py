"""GUI rollouts: a Tk form in a GUI workspace, half filled in by scripted input, forked into a group of four live
copies that each finish it with a different answer. Screenshots of the parent and of every copy are saved as PNG.

    sudo .venv/bin/python examples/gui_rollouts.py [--out DIR]

Needs root (workspaces) and the GUI image (``bunshin image build --gui``; ``make setup`` builds it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import anyio

from bunshin_async import Display, Workspace

# The application under test, written into the workspace. It reports where its widgets are once drawn, and
# writes what was submitted to answer.txt. The insertion cursor does not blink, so an idle screen is stable.
FORM_APP = """
import json, os, tkinter as tk
root = tk.Tk(); root.title("quiz"); root.geometry("460x170+60+60")
tk.Label(root, text="Name a prime number greater than 10:").pack(pady=6)
entry = tk.Entry(root, width=34, insertofftime=0); entry.pack()
result = tk.Label(root, text="(not submitted)")
def submit(event=None):
    result.config(text="Submitted: " + entry.get())
    with open("/workspace/answer.txt", "w") as f:
        f.write(entry.get())
tk.Button(root, text="Submit", command=submit).pack(pady=6); result.pack()
entry.bind("<Return>", submit)
def ready():
    root.update_idletasks()
    x, y = entry.winfo_rootx() + entry.winfo_width() // 2, entry.winfo_rooty() + entry.winfo_height() // 2
    with open("/workspace/ready.tmp", "w") as f:
        json.dump({"entry": [x, y]}, f)
    os.rename("/workspace/ready.tmp", "/workspace/ready.json")
root.after(200, ready)
root.mainloop()
"""

ANSWERS = ["11", "13", "17", "19"]


async def read_when_there(ws: Workspace, path: str, timeout: float = 20) -> str:
    """The content of ``path`` in the workspace, once the application has written it."""
    with anyio.fail_after(timeout):
        while True:
            res = await ws.exec(["cat", path])
            if res.exit_code == 0:
                return res.stdout
            await anyio.sleep(0.05)


async def stable_screenshot(ws: Workspace) -> bytes:
    """A screenshot once the application has finished drawing (two in a row agree)."""
    last = await ws.gui.screenshot()
    with anyio.fail_after(10):
        while True:
            await anyio.sleep(0.05)
            shot = await ws.gui.screenshot()
            if shot.digest == last.digest:
                return shot.png
            last = shot


async def finish(ws: Workspace, answer: str, out: Path, i: int, report: dict[str, object]) -> None:
    """One rollout: type this copy's answer, submit, save the screen, read back what the application stored."""
    t0 = time.monotonic()
    await ws.gui.type_text(answer)
    await ws.gui.key("Return")
    stored = await read_when_there(ws, "/workspace/answer.txt")
    await anyio.Path(out / f"copy{i}.png").write_bytes(await stable_screenshot(ws))
    report[f"copy{i}"] = {
        "typed": answer,
        "stored": stored,
        "digest": (await ws.gui.screenshot()).digest[:16],
        "seconds": round(time.monotonic() - t0, 3),
    }


async def main(out: Path) -> None:
    await anyio.Path(out).mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {}
    async with Workspace(display=Display(width=800, height=600)) as parent:
        await parent.write_file("/workspace/form.py", FORM_APP)
        await parent.spawn(["python3", "/workspace/form.py"], log_path="/workspace/form.log")
        positions: dict[str, list[int]] = json.loads(await read_when_there(parent, "/workspace/ready.json"))
        # The shared prefix of every rollout: focus the entry (scripted here; an agent would pick the point from
        # a screenshot).
        await parent.gui.click(*positions["entry"])
        await anyio.Path(out / "parent-before.png").write_bytes(await stable_screenshot(parent))
        before = (await parent.gui.screenshot()).digest

        t0 = time.monotonic()
        copies = await parent.fork(len(ANSWERS))
        report["fork_seconds"] = round(time.monotonic() - t0, 3)
        try:
            report["copies_equal_parent"] = [(await ws.gui.screenshot()).digest == before for ws in copies]
            async with anyio.create_task_group() as tg:
                for i, (ws, answer) in enumerate(zip(copies, ANSWERS, strict=True)):
                    tg.start_soon(finish, ws, answer, out, i, report)
        finally:
            for ws in copies:
                await ws.aclose()
        await anyio.Path(out / "parent-after.png").write_bytes(await stable_screenshot(parent))
        report["parent_unchanged"] = (await parent.gui.screenshot()).digest == before
    report["screenshots"] = str(out)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bunshin-gui-rollouts")
    anyio.run(main, ap.parse_args().out)
