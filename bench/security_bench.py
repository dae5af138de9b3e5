"""The security boundary's cost, in wall time and in CPU time, with the boundary on (``Security()``) and off
(``Security.off()``; with ``--compare userns`` only its user namespace off, ``Security(userns=False)``) alternated in
one run: a cold workspace's create + first exec + close, and a fork of a
workspace holding ``--mib`` MiB of Python state (snapshot + copy-on-write restore of one copy + close).

CPU time is this process's plus that of every reaped child (the shim and the whole workspace tree under it, CRIU),
so it counts what the boundary makes the kernel and CRIU do, and stays meaningful when other work shares the cores
and wall times stretch. Prints one JSON object; medians and p90 in milliseconds, ratios on / off.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import summary  # noqa: E402

from bunshin_async import Security, Workspace  # noqa: E402

GUEST = Path(__file__).resolve().parent.parent / "tests" / "fork" / "guest_state.py"


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


async def _parent(mib: int, security: Security) -> Workspace:
    ws = Workspace(security=security)
    await ws.start()
    await ws.write_file("/workspace/guest_state.py", GUEST.read_bytes())
    await ws.spawn(["python3", "/workspace/guest_state.py", "server", str(mib)])
    with anyio.fail_after(300):
        while (await ws.exec("cat /workspace/digest 2>/dev/null")).exit_code:  # noqa: ASYNC110 - polls the guest
            await anyio.sleep(0.05)
    return ws


COMPARE = {
    "boundary": {"on": Security(), "off": Security.off()},
    "userns": {"on": Security(), "off": Security(userns=False)},
}
"""``--compare``: the whole boundary on vs off, or only its user namespace (everything else on in both)."""


async def main(reps: int, mib: int, compare: str) -> None:
    os.environ["BUNSHIN_FORK_MODE"] = "cow"
    configs = COMPARE[compare]
    samples = {name: {"create_wall": [], "create_cpu": [], "fork_wall": [], "fork_cpu": []} for name in configs}
    parents = {name: await _parent(mib, sec) for name, sec in configs.items()}
    try:
        for rep in range(reps):
            for name in list(configs) if rep % 2 == 0 else list(configs)[::-1]:
                s = samples[name]
                c0, t0 = _cpu(), time.perf_counter()
                async with Workspace(security=configs[name]) as ws:
                    await ws.exec(["true"])
                    s["create_wall"].append(time.perf_counter() - t0)
                s["create_cpu"].append(_cpu() - c0)
                c0, t0 = _cpu(), time.perf_counter()
                (copy,) = await parents[name].fork()
                s["fork_wall"].append(time.perf_counter() - t0)
                await copy.aclose()
                s["fork_cpu"].append(_cpu() - c0)
    finally:
        for ws in parents.values():
            await ws.aclose()
    out: dict[str, object] = {
        "benchmark": "security" if compare == "boundary" else f"security-{compare}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "reps": reps,
        "mib": mib,
        "load_average": os.getloadavg(),
    }
    for name in configs:
        out[name] = {key: summary(values) for key, values in samples[name].items()}
    ratios = {}
    for key in samples["on"]:
        on, off = out["on"][key]["median"], out["off"][key]["median"]  # type: ignore[index]
        ratios[key] = round(on / off, 3)
    out["on_over_off"] = ratios
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--compare", choices=tuple(COMPARE), default="boundary")
    args = ap.parse_args()
    anyio.run(main, args.reps, args.mib, args.compare)
