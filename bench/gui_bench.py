"""GUI fork benchmark: a GUI workspace (Xvfb + a Tk form + an xterm; ``--gl`` adds glxgears) forked n = 1, 4, 16
ways in each available restore mode (stock CRIU, and copy-on-write restore where the patched CRIU is built),
against starting the same GUI state cold. Prints JSON; never fails because the machine is slow.

    BUNSHIN_RUNDIR=/tmp/gui-ws .venv/bin/python bench/gui_bench.py --repeat 2

Each fork is checked: every copy's screenshot must equal the parent's (digest). The published anchor is a
modified-kernel GUI container fork (3.7 s per branch, about 0.56 GiB per copy in a 16-way fan-out); its
container ran a fuller desktop, so compare shapes (how latency and memory grow with n), not only absolutes.

With ``--gl`` every restored copy starts rendering at once (llvmpipe, on the CPU), so on a host with few cores the
copies restored first slow the restore of the rest; read those numbers with ``cpus`` in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _stats import pss_kib, summary  # noqa: E402

from bunshin_async import Workspace  # noqa: E402
from bunshin_async._fork._modes import cow_available  # noqa: E402

FORM = Path(__file__).resolve().parent.parent / "tests" / "workspace" / "gui" / "form_app.py"
ANCHOR_S_PER_BRANCH = 3.7
ANCHOR_GIB_PER_COPY = 0.56
ANCHOR = {
    "what": "modified-kernel GUI container fork, 16-way fan-out",
    "s_per_branch": ANCHOR_S_PER_BRANCH,
    "gib_per_copy": ANCHOR_GIB_PER_COPY,
}


def _pss_mib(ws: Workspace) -> float:
    assert ws.cgroup is not None
    return pss_kib(ws.cgroup.pids()) / 1024


async def _until(ws: Workspace, cmd: str, timeout: float = 30) -> None:
    with anyio.fail_after(timeout):
        while True:
            if (await ws.exec(cmd)).exit_code == 0:
                return
            await anyio.sleep(0.05)


async def _gui_state(gl: bool) -> tuple[Workspace, float]:
    """A GUI workspace with its applications up and drawn; returns it and the seconds it took."""
    t0 = time.monotonic()
    ws = Workspace(display=True)
    await ws.start()
    await ws.write_file("/workspace/form_app.py", FORM.read_bytes())
    await ws.spawn(["python3", "/workspace/form_app.py"])
    await ws.spawn("xterm -geometry 80x20+40+260")
    if gl:
        await ws.spawn("glxgears -geometry 200x200+600+40")
    await _until(ws, "test -f /workspace/ready.json")
    want = 3 if gl else 2
    with anyio.fail_after(30):
        while True:
            if len(await ws.gui.windows()) >= want:
                break
            await anyio.sleep(0.05)
    return ws, time.monotonic() - t0


async def _settled(ws: Workspace) -> str:
    last = ""
    with anyio.fail_after(10):
        while True:
            digest = (await ws.gui.screenshot()).digest
            if digest == last:
                return digest
            last = digest
            await anyio.sleep(0.05)


async def bench_mode(parent: Workspace, mode: str, ns: list[int], repeat: int, gl: bool) -> dict[str, dict[str, Any]]:
    os.environ["BUNSHIN_FORK_MODE"] = mode
    out: dict[str, dict[str, Any]] = {}
    for n in ns:
        total, snap_s, restore, per_copy, mismatches = [], [], [], [], 0
        got_mode = ""
        for _ in range(repeat):
            digest = None if gl else await _settled(parent)
            t0 = time.monotonic()
            snap = await parent.snapshot()
            t1 = time.monotonic()
            try:
                copies = await Workspace.from_snapshot(snap, n)
            finally:
                await snap.aclose()
            t2 = time.monotonic()
            try:
                got_mode = copies[0].fork_mode
                for ws in copies:  # the display came along: same pixels, and it answers
                    shot = await ws.gui.screenshot()
                    mismatches += digest is not None and shot.digest != digest
                per_copy.append(statistics.mean(_pss_mib(ws) for ws in copies))
            finally:
                for ws in copies:
                    await ws.aclose()
            total.append(t2 - t0)
            snap_s.append(t1 - t0)
            restore.append(t2 - t1)
        med_total = statistics.median(total)
        out[f"n{n}"] = {
            "fork_mode": got_mode,
            "fork_total_ms": summary(total),
            "snapshot_ms": summary(snap_s),
            "restore_all_ms": summary(restore),
            "amortized_ms_per_branch": round(med_total / n * 1000, 1),
            "per_copy_pss_mib": round(statistics.median(per_copy), 1),
            "screenshot_mismatches": mismatches,
            "vs_anchor": {
                "latency_ratio": round(med_total / ANCHOR_S_PER_BRANCH, 4),
                "memory_ratio": round(statistics.median(per_copy) / 1024 / ANCHOR_GIB_PER_COPY, 4),
            },
        }
    return out


async def main(ns: list[int], repeat: int, gl: bool, modes: list[str]) -> None:
    saved = os.environ.get("BUNSHIN_FORK_MODE")
    cold = []
    for _ in range(repeat):
        ws, seconds = await _gui_state(gl)
        cold.append(seconds)
        await ws.aclose()
    result: dict[str, object] = {
        "apps": ["Xvfb 1024x768x24", "Tk form", "xterm"] + (["glxgears (llvmpipe)"] if gl else []),
        "cpus": os.cpu_count(),
        "cold_gui_start_ms": summary(cold),
        "anchor": ANCHOR,
    }
    available = ["criu"] + (["criu-cow"] if cow_available() else [])
    parent, _ = await _gui_state(gl)
    try:
        if not gl:
            await _settled(parent)
        result["parent_pss_mib"] = round(_pss_mib(parent), 1)
        by_mode: dict[str, dict[str, dict[str, Any]]] = {}
        result["modes"] = by_mode
        for mode in modes or available:
            by_mode[mode] = await bench_mode(parent, mode, ns, repeat, gl)
    finally:
        await parent.aclose()
        if saved is None:
            os.environ.pop("BUNSHIN_FORK_MODE", None)
        else:
            os.environ["BUNSHIN_FORK_MODE"] = saved
    # One line per mode and n: what the issue compares side by side.
    result["side_by_side"] = [
        {
            "mode": mode,
            "n": int(key[1:]),
            "fork_ms": row["fork_total_ms"]["median"],
            "amortized_ms_per_branch": row["amortized_ms_per_branch"],
            "per_copy_pss_mib": row["per_copy_pss_mib"],
        }
        for mode, rows in by_mode.items()
        for key, row in rows.items()
    ]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--gl", action="store_true", help="add glxgears (its animation skips the pixel check)")
    ap.add_argument("--modes", nargs="*", default=[], help="criu, criu-cow, criu-ksm (default: all available)")
    args = ap.parse_args()
    anyio.run(main, args.n, args.repeat, args.gl, args.modes)
