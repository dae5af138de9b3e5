"""What the agent's connection threads cost a dump (issue #38's pool, docs/concepts/workspace.md): two idle workspaces
alive at once, whose agents hold pools of ``--a`` and ``--b`` threads, snapshotted in turns (one of each per round,
their order alternating) so that both see the same load; per round, the difference of the pause (``dump_ms``) and
of CRIU's frozen time (its stats-dump image), then their quartiles, and each side's median, the size of its images
and its agent's anonymous memory. Prints JSON; never fails because the machine is slow.

    .venv/bin/python bench/agent_threads.py --a 1 --b 33 --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import anyio

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._workspace import _core


def _frozen_ms(snap: Snapshot) -> float:
    import pycriu.images  # on sys.path once bunshin_async._host._criu is imported

    with open(record_of(snap).images / "stats-dump", "rb") as f:
        entry: dict[str, Any] = pycriu.images.load(f)["entries"][0]["dump"]
    return int(entry.get("frozen_time", 0)) / 1e3


def _agent_anon_kib(ws: Workspace) -> int:
    pid1 = ws._core.pid
    agent = Path(f"/proc/{pid1}/task/{pid1}/children").read_text().split()[0]
    rollup = Path(f"/proc/{agent}/smaps_rollup").read_text()
    return next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Anonymous:"))


async def _start(threads: int) -> Workspace:
    _core.agent_threads = lambda pids: threads  # type: ignore[assignment]  # this workspace's pool
    ws = Workspace()
    await ws.start()
    await ws.exec("true")
    return ws


def _quartiles(xs: list[float]) -> list[float]:
    return [round(q, 2) for q in statistics.quantiles(xs, n=4)]


async def main(a: int, b: int, rounds: int) -> dict[str, Any]:
    sides = {"a": await _start(a), "b": await _start(b)}
    rows: list[dict[str, tuple[float, float, int]]] = []
    try:
        for i in range(rounds):
            row: dict[str, tuple[float, float, int]] = {}
            for name in ("a", "b") if i % 2 == 0 else ("b", "a"):
                ws = sides[name]
                await ws.exec("true")  # a connection open before the dump, as after a tool call
                async with await ws.snapshot() as snap:
                    images = sum(p.stat().st_size for p in record_of(snap).images.iterdir())
                    row[name] = (snap.dump_ms or 0.0, _frozen_ms(snap), images)
            rows.append(row)
        anon = {name: _agent_anon_kib(ws) for name, ws in sides.items()}
    finally:
        for ws in sides.values():
            await ws.aclose()
    out: dict[str, Any] = {"threads": {"a": a, "b": b}, "rounds": rounds, "load": os.getloadavg()}
    for name in ("a", "b"):
        out[name] = {
            "dump_ms_median": round(statistics.median(r[name][0] for r in rows), 2),
            "frozen_ms_median": round(statistics.median(r[name][1] for r in rows), 2),
            "images_kib_median": statistics.median(r[name][2] for r in rows) / 1024,
            "agent_anon_kib": anon[name],
        }
    out["b_minus_a"] = {
        "dump_ms_quartiles": _quartiles([r["b"][0] - r["a"][0] for r in rows]),
        "frozen_ms_quartiles": _quartiles([r["b"][1] - r["a"][1] for r in rows]),
    }
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=int, default=1)
    ap.add_argument("--b", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    print(json.dumps(anyio.run(main, args.a, args.b, args.rounds), indent=1))
