"""Fork latency and memory: a workspace holding ``--mib`` MiB of non-uniform Python state, forked n = 1, 4, 8 ways,
against creating the same state cold, for each restore mode side by side (``--modes``: ``criu`` = stock CRIU,
``cow`` = CoW restore with the patched CRIU, ``ksm`` = stock restore into KSM-mergeable tasks). Prints JSON; never
fails because the machine is slow.

Memory per mode and n: ``total_pss_mib`` / ``per_copy_private_mib`` as restored, and the same ``*_resident`` after
every page of each copy's CoW image mappings was read once (through /proc/PID/mem, as a reader inside would), which is
the honest figure for CoW copies: an untouched image page is in no one's PSS. For ``ksm`` the figures are taken
after ``--ksm-wait`` seconds of merging. ``warm_spares``: ``from_snapshot`` latency with ``--spares`` warm spares
(``snap.keep_spares``: frozen pre-restored copies handed out thawed), median/p90, against plain restores.

    BUNSHIN_RUNDIR=/tmp/fork-ws .venv/bin/python bench/fork_bench.py --mib 200 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import anyio

from bunshin_async import Workspace

GUEST = Path(__file__).resolve().parent.parent / "tests" / "fork" / "guest_state.py"


def _rollup_kib(ws: Workspace, *keys: str) -> int:
    total = 0
    assert ws.cgroup is not None
    for pid in ws.cgroup.pids():
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.split(":", 1)[0] in keys:
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def _pss_kib(ws: Workspace) -> int:
    return _rollup_kib(ws, "Pss")


def _private_kib(ws: Workspace) -> int:
    return _rollup_kib(ws, "Private_Clean", "Private_Dirty")


def _fault_in_images(ws: Workspace) -> None:
    """Read each page of the copy's CoW image mappings once (a no-op for stock and KSM copies)."""
    assert ws.cgroup is not None
    for pid in ws.cgroup.pids():
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) < 6 or "/pages-" not in fields[5]:
                        continue
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    for off in range(lo, hi, 1 << 20):
                        mem.seek(off)
                        mem.read(min(1 << 20, hi - off))
        except OSError:
            pass


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


async def _warm_spares(parent: Workspace, k: int, n: int) -> dict[str, object]:
    """``from_snapshot`` latency with ``k`` warm spares (frozen pre-restored copies), waiting for the pool to refill
    between takes, against the same call without spares (a CRIU restore); each copy is pinged before it counts."""
    warm: list[float] = []
    cold: list[float] = []
    async with await parent.snapshot() as snap:
        for _ in range(n):
            t0 = time.monotonic()
            [c] = await Workspace.from_snapshot(snap)
            await c.ping()
            cold.append((time.monotonic() - t0) * 1000)
            await c.aclose()
        async with snap.keep_spares(k) as pool:
            for _ in range(n):
                with anyio.fail_after(300):
                    await pool.wait_ready()
                t0 = time.monotonic()
                [c] = await Workspace.from_snapshot(snap)
                warm.append((time.monotonic() - t0) * 1000)
                await c.ping()
                await c.aclose()
    return {"spares": k, "from_snapshot_ms": _stats(warm), "without_spares_ms_incl_ping": _stats(cold)}


async def main(mib: int, repeat: int, modes: list[str], ksm_wait: float, spares: int = 2) -> None:
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
        for mode in modes:
            os.environ["BUNSHIN_FORK_MODE"] = mode
            per_mode: dict[str, object] = {}
            for n in (1, 4, 8):
                total: list[float] = []
                dump: list[float] = []
                restore: list[float] = []
                per_restore: list[float] = []
                pss: list[float] = []
                priv: list[float] = []
                pss_res: list[float] = []
                priv_res: list[float] = []
                for _ in range(repeat):
                    t0 = time.monotonic()
                    snap = await parent.snapshot()
                    t1 = time.monotonic()
                    copies = await Workspace.from_snapshot(snap, n)
                    t2 = time.monotonic()
                    await snap.aclose()
                    total.append((t2 - t0) * 1000)
                    dump.append((t1 - t0) * 1000)
                    restore.append((t2 - t1) * 1000)
                    per_restore.extend(c.restore_ms or 0.0 for c in copies)
                    if mode == "ksm":
                        await anyio.sleep(ksm_wait)
                    pss.append(sum(_pss_kib(c) for c in copies) / 1024)
                    priv.append(sum(_private_kib(c) for c in copies) / 1024)
                    for c in copies:
                        await anyio.to_thread.run_sync(_fault_in_images, c)
                    pss_res.append(sum(_pss_kib(c) for c in copies) / 1024)
                    priv_res.append(sum(_private_kib(c) for c in copies) / 1024)
                    fork_mode = copies[0].fork_mode
                    for c in copies:
                        await c.aclose()
                per_mode[f"n{n}"] = {
                    "fork_mode": fork_mode,
                    "fork_total_ms": _stats(total),
                    "snapshot_ms": _stats(dump),
                    "restore_all_ms": _stats(restore),
                    "restore_each_ms": _stats(per_restore),
                    "total_pss_mib": round(statistics.median(pss), 1),
                    "per_copy_private_mib": round(statistics.median(priv) / n, 1),
                    "total_pss_mib_resident": round(statistics.median(pss_res), 1),
                    "per_copy_private_mib_resident": round(statistics.median(priv_res) / n, 1),
                    "speedup_vs_cold": round(statistics.median(cold_state) / statistics.median(total), 2),
                }
            out[mode] = per_mode
        out["warm_spares"] = await _warm_spares(parent, spares, max(5, repeat * 3))
    finally:
        await parent.aclose()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="criu,cow", help="comma-separated BUNSHIN_FORK_MODE values (criu, cow, ksm)")
    ap.add_argument("--ksm-wait", type=float, default=10.0, help="seconds of merging before ksm copies are measured")
    ap.add_argument("--spares", type=int, default=2, help="warm spares kept for the from-snapshot measurement")
    args = ap.parse_args()
    try:
        anyio.run(main, args.mib, args.repeat, args.modes.split(","), args.ksm_wait, args.spares)
    finally:
        from bunshin_async._fork import ksm_restore

        ksm_restore()
