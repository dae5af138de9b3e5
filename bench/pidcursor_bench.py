"""The pid cursor's cost (issue #38, ``_host/_pidcursor.py``): what a speculative read run in place pays for putting
the namespace's cursor back, and what the exec round trip pays for the ledger when no read runs.

Paired in one process, blocks alternated (A B B A ...), so both sides see the same machine load:

- ``exec``: the exec round trip (``ws.exec(["true"])``) through ``AgentClient.request`` as it is, and through the
  request without the ledger (the code before it), swapped per block on the same workspace.
- ``read``: an unused read run in place (``in_place(ws)`` around ``exec("true")``), then the main line's next exec
  (where the cursor is put back): each of the two timed, against the same two execs without the read's scope.
- ``used``: the same, the read used (``ReadPids.use``): nothing to put back.

Prints one JSON object; times in milliseconds (median, p90, min, max over blocks' samples) and the paired medians'
difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import summary  # noqa: E402

from bunshin_async import Workspace  # noqa: E402
from bunshin_async._host import _protocol as P  # noqa: E402
from bunshin_async._host._client import AgentClient  # noqa: E402
from bunshin_async._workspace._facade import in_place  # noqa: E402

WITH_LEDGER = AgentClient.request


async def _without_ledger(self: AgentClient, req: P.Request) -> P.Response:
    """``AgentClient.request`` before the pid cursor (main 6a0aec3)."""
    while not self._open.is_set():
        await self._open.wait()
    self._in_flight += 1
    try:
        return await self._request(req)
    finally:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._drained.set()


async def exec_blocks(ws: Workspace, blocks: int, per: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"ledger": [], "none": []}
    for i in range(blocks):
        for side in ("ledger", "none") if i % 2 == 0 else ("none", "ledger"):
            AgentClient.request = WITH_LEDGER if side == "ledger" else _without_ledger  # type: ignore[method-assign]
            try:
                for _ in range(5):
                    await ws.exec(["true"])
                for _ in range(per):
                    t = time.perf_counter()
                    await ws.exec(["true"])
                    out[side].append(time.perf_counter() - t)
            finally:
                AgentClient.request = WITH_LEDGER  # type: ignore[method-assign]
    return out


async def read_blocks(ws: Workspace, blocks: int, per: int, *, used: bool) -> dict[str, list[float]]:
    """Per sample: the read (in place or not) and the main line's next exec."""
    out: dict[str, list[float]] = {"read_scoped": [], "next_scoped": [], "read_plain": [], "next_plain": []}
    for i in range(blocks):
        for side in ("scoped", "plain") if i % 2 == 0 else ("plain", "scoped"):
            for _ in range(per):
                t = time.perf_counter()
                if side == "scoped":
                    async with in_place(ws) as read:
                        await ws.exec(["true"])
                    if used:
                        read.use()
                else:
                    await ws.exec(["true"])
                t1 = time.perf_counter()
                await ws.exec(["true"])
                t2 = time.perf_counter()
                out[f"read_{side}"].append(t1 - t)
                out[f"next_{side}"].append(t2 - t1)
    return out


def _paired(a: list[float], b: list[float]) -> float:
    return round((statistics.median(a) - statistics.median(b)) * 1000, 3)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--per", type=int, default=20)
    args = ap.parse_args()
    async with Workspace() as ws:
        execs = await exec_blocks(ws, args.blocks, args.per)
        unused = await read_blocks(ws, args.blocks, args.per // 2, used=False)
        used = await read_blocks(ws, args.blocks, args.per // 2, used=True)
        pids = ws._core.client.pids if ws._core.client is not None else None
        settled = (pids.settled, pids.forward) if pids is not None else None
    result = {
        "benchmark": "pidcursor",
        "loadavg": os.getloadavg(),
        "exec": {k: summary(v) for k, v in execs.items()} | {"ledger_minus_none_ms": _paired(*execs.values())},
        "unused_read": {k: summary(v) for k, v in unused.items()}
        | {
            "read_extra_ms": _paired(unused["read_scoped"], unused["read_plain"]),
            "next_exec_extra_ms": _paired(unused["next_scoped"], unused["next_plain"]),
        },
        "used_read": {k: summary(v) for k, v in used.items()}
        | {
            "read_extra_ms": _paired(used["read_scoped"], used["read_plain"]),
            "next_exec_extra_ms": _paired(used["next_scoped"], used["next_plain"]),
        },
        "settled_forward": settled,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    anyio.run(main)
