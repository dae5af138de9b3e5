"""Fork latency and memory: a workspace holding ``--mib`` MiB of non-uniform Python state, forked n = 1, 4, 8 ways,
against creating the same state cold. Prints JSON; never fails because the machine is slow.

    BUNSHIN_RUNDIR=/tmp/fork-ws .venv/bin/python bench/fork_bench.py --mib 200 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import anyio

from bunshin_async import Workspace

GUEST = Path(__file__).resolve().parent.parent / "tests" / "fork" / "guest_state.py"


def _pss_kib(ws: Workspace) -> int:
    total = 0
    assert ws.cgroup is not None
    for pid in ws.cgroup.pids():
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median": round(statistics.median(xs), 1), "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 1)}


async def _with_state(mib: int) -> tuple[Workspace, float]:
    t0 = time.monotonic()
    ws = Workspace()
    await ws.start()
    await ws.write_file("/workspace/guest_state.py", GUEST.read_bytes())
    await ws.spawn(["python3", "/workspace/guest_state.py", "server", str(mib)])
    with anyio.fail_after(300):
        while (await ws.exec("cat /workspace/digest 2>/dev/null")).exit_code:  # noqa: ASYNC110 - polls the guest
            await anyio.sleep(0.05)
    return ws, (time.monotonic() - t0) * 1000


async def main(mib: int, repeat: int) -> None:
    cold_start, cold_state = [], []
    for _ in range(repeat):
        t0 = time.monotonic()
        async with Workspace():
            cold_start.append((time.monotonic() - t0) * 1000)
        ws, ms = await _with_state(mib)
        cold_state.append(ms)
        await ws.aclose()
    out: dict[str, object] = {
        "mib": mib,
        "cold_start_ms": _stats(cold_start),
        "cold_with_state_ms": _stats(cold_state),
    }
    parent, _ = await _with_state(mib)
    try:
        out["parent_pss_mib"] = round(_pss_kib(parent) / 1024, 1)
        for n in (1, 4, 8):
            total, dump, restore, pss = [], [], [], []
            for _ in range(repeat):
                t0 = time.monotonic()
                snap = await parent.snapshot()
                t1 = time.monotonic()
                copies = await Workspace.from_snapshot(snap, n)
                t2 = time.monotonic()
                total.append((t2 - t0) * 1000)
                dump.append((t1 - t0) * 1000)
                restore.append((t2 - t1) * 1000)
                pss.append(sum(_pss_kib(c) for c in copies) / 1024)
                mode = copies[0].fork_mode
                for c in copies:
                    await c.aclose()
                await snap.aclose()
            out[f"fork_n{n}"] = {
                "mode": mode,
                "total_ms": _stats(total),
                "snapshot_ms": _stats(dump),
                "restore_all_ms": _stats(restore),
                "per_copy_pss_mib": round(statistics.median(pss) / n, 1),
                "total_pss_mib": round(statistics.median(pss), 1),
                "speedup_vs_cold": round(statistics.median(cold_state) / statistics.median(total), 2),
            }
    finally:
        await parent.aclose()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    anyio.run(main, args.mib, args.repeat)
