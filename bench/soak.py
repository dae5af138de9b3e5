"""Soak: long fork/discard runs of a workspace holding 50 MiB (issue #20), for longer than CI runs them
(tests/reliability/test_cycles.py). Samples what this process holds on the host (tests/reliability/campaign.py:
processes, mounts, cgroups, snapshot-store bytes, run-dir entries, descriptors, RSS) ``--samples`` times and
reports growth past the stated bounds (host counts: none; descriptors: 2; RSS: 16 MiB) as ``leaks``. Prints JSON;
never fails because the machine is slow.

    .venv/bin/python bench/soak.py --cycles 10000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bunshin_async import Workspace  # noqa: E402
from bunshin_async._host._kernel import CGROUP_ROOT, parent_name  # noqa: E402
from bunshin_async._host._snapstore import prepare_snapshot_store  # noqa: E402
from tests.reliability.campaign import HostState, fork_cycles, holding_workspace  # noqa: E402

FD_BOUND = 2
RSS_BOUND_MIB = 16.0


async def soak(cycles: int, mib: int, samples: int) -> dict[str, object]:
    t0 = time.monotonic()
    async with Workspace() as ws:
        await holding_workspace(ws, mib)
        result = await fork_cycles(ws, cycles, samples=samples)
    base = HostState(**result["baseline"])
    leaks = {}
    for sample in result["trace"]:
        now = HostState(**{k: v for k, v in sample.items() if k != "cycle"})
        found = now.leaks(base, fds=FD_BOUND, rss_mib=RSS_BOUND_MIB)
        if found:
            leaks[sample["cycle"]] = found
    rss = [s["rss_mib"] for s in result["trace"]]
    return {
        "benchmark": "soak",
        "state_mib": mib,
        **result,
        "bounds": {"host_counts": 0, "fds": FD_BOUND, "rss_mib": RSS_BOUND_MIB},
        "rss_growth_mib": round(max(rss) - base.rss_mib, 2),
        "leaks": leaks,
        "wall_s": round(time.monotonic() - t0, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--mib", type=int, default=50)
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()
    # A run dir, snapshot dir and cgroup parent of its own, so that the counts see this run only.
    os.environ.setdefault("BUNSHIN_RUNDIR", tempfile.mkdtemp(prefix="bunshin-soak-"))
    os.environ.setdefault("BUNSHIN_CGROUP_PARENT", f"bunshin-soak-{os.getpid()}")
    own_store = "BUNSHIN_SNAPDIR" not in os.environ
    if own_store:  # a tmpfs with large folios of its own (prepare_snapshot_store), unmounted at the end
        os.environ["BUNSHIN_SNAPDIR"] = tempfile.mkdtemp(prefix="bunshin-soak-snap-", dir="/dev/shm")
        prepare_snapshot_store()
    try:
        out = anyio.run(soak, args.cycles, args.mib, args.samples)
    finally:
        if own_store:
            subprocess.run(["umount", os.environ["BUNSHIN_SNAPDIR"]], check=False)
            os.rmdir(os.environ["BUNSHIN_SNAPDIR"])
        shutil.rmtree(os.environ["BUNSHIN_RUNDIR"], ignore_errors=True)
        for ctrl in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()]:  # the (empty) cgroup parent of this run
            with contextlib.suppress(OSError):
                (ctrl / parent_name()).rmdir()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
