"""The reliability campaign's parts, shared by tests/reliability (CI counts) and bench/soak.py (long runs): what
this process holds on the host (``host_state``), and long fork/discard runs that sample it (``fork_cycles``).

Counted, for this process's own run dir, snapshot dir and cgroup parent only (others share the machine): host
processes (our descendants and every task in our cgroups), mounts that name our run or snapshot dir, our cgroups,
bytes in the snapshot store and entries in the run dir, and this process's open descriptors and resident memory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import psutil

from bunshin_async import Workspace
from bunshin_async._host import _paths
from bunshin_async._host._kernel import CGROUP_ROOT, parent_name
from bunshin_async._host._snapstore import snapshot_dir

STATE_MIB = 50
HOLDER = (
    "import os, sys, time\n"
    "b = bytearray(os.urandom(int(sys.argv[1]) << 20))\n"  # written, distinct pages: nothing for KSM or zero pages
    "open('/tmp/ready', 'w').close()\n"
    "time.sleep(1e9)\n"
)


class HostState(msgspec.Struct, frozen=True):
    processes: int
    mounts: int
    cgroups: int
    store_bytes: int
    run_entries: int
    fds: int
    rss_mib: float

    def leaks(self, base: HostState, *, fds: int = 0, rss_mib: float = 0.0) -> dict[str, tuple[float, float]]:
        """What grew past ``base`` by more than the bound (none for the host counts): name -> (base, now)."""
        out: dict[str, tuple[float, float]] = {}
        for name in ("processes", "mounts", "cgroups", "store_bytes", "run_entries"):
            if getattr(self, name) > getattr(base, name):
                out[name] = (getattr(base, name), getattr(self, name))
        if self.fds > base.fds + fds:
            out["fds"] = (base.fds, self.fds)
        if self.rss_mib > base.rss_mib + rss_mib:
            out["rss_mib"] = (base.rss_mib, self.rss_mib)
        return out


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def host_processes() -> dict[int, str]:
    """This process's descendants and every process in its workspaces' cgroups: pid -> what it is."""
    procs = {p.pid: p for p in psutil.Process().children(recursive=True)}
    for ctrl in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()] if CGROUP_ROOT.exists() else []:
        parent = ctrl / parent_name()
        for root, _dirs, _files in os.walk(parent) if parent.is_dir() else []:
            try:
                for pid in {int(x) for x in Path(root, "cgroup.procs").read_text().split()} - procs.keys():
                    procs[pid] = psutil.Process(pid)
            except (OSError, psutil.NoSuchProcess):
                pass
    out = {}
    for pid, proc in procs.items():
        try:
            out[pid] = f"{pid} {proc.status()} ppid {proc.ppid()} {' '.join(proc.cmdline())[:120] or proc.name()}"
        except psutil.NoSuchProcess:
            pass
    return out


def host_state() -> HostState:
    """What this process holds on the host now (blocking)."""
    rundir, snaps = str(_paths.workspaces_dir()), str(snapshot_dir())
    pids = host_processes()
    cgroups = 0
    for ctrl in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()] if CGROUP_ROOT.exists() else []:
        parent = ctrl / parent_name()
        for _root, dirs, _files in os.walk(parent) if parent.is_dir() else []:
            cgroups += len(dirs)
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for line in f if rundir in line.split()[4] or line.split()[4].startswith(snaps + "/"))
    base = Path(rundir)
    entries = sum(1 for _ in base.rglob("*")) if base.exists() else 0
    store = Path(snaps)
    return HostState(
        processes=len(pids),
        mounts=mounts,
        cgroups=cgroups,
        store_bytes=_tree_bytes(store) if store.exists() else 0,
        run_entries=entries,
        fds=len(os.listdir("/proc/self/fd")),
        rss_mib=psutil.Process().memory_info().rss / (1 << 20),
    )


async def holding_workspace(ws: Workspace, mib: int = STATE_MIB) -> None:
    """Make ``ws`` hold ``mib`` MiB of written process memory (a Python process that keeps it)."""
    await ws.write_file("/workspace/hold.py", HOLDER)
    await ws.spawn(["python3", "/workspace/hold.py", str(mib)])
    with anyio.fail_after(60):
        while (await ws.exec("test -e /tmp/ready")).exit_code != 0:
            await anyio.sleep(0.05)


async def settled_state(timeout: float = 5.0) -> HostState:
    """``host_state`` once processes being reaped are gone (the host counts can only fall while settling)."""
    state = await anyio.to_thread.run_sync(host_state)
    with anyio.move_on_after(timeout):
        while True:
            await anyio.sleep(0.05)
            now = await anyio.to_thread.run_sync(host_state)
            if now.processes >= state.processes and now.mounts >= state.mounts:
                return now
            state = now
    return state


async def fork_cycles(ws: Workspace, cycles: int, *, samples: int = 10) -> dict[str, Any]:
    """``cycles`` fork/discard cycles of ``ws`` (``fork(1)``, an exec in the copy, ``aclose()``). Samples
    ``host_state`` ``samples`` times; the baseline is taken after the first cycle (first-use caches: imports,
    CRIU's kdat, the thread pool), so growth means a leak."""
    (first,) = await ws.fork(1)
    await first.aclose()
    base = await settled_state()
    every = max(1, cycles // samples)
    trace: list[dict[str, Any]] = []
    t0 = time.monotonic()
    lat: list[float] = []
    for i in range(1, cycles + 1):
        t = time.monotonic()
        (copy,) = await ws.fork(1)
        try:
            r = await copy.exec("test -e /tmp/ready")
            assert r.exit_code == 0
        finally:
            await copy.aclose()
        lat.append((time.monotonic() - t) * 1000)
        if i % every == 0 or i == cycles:
            trace.append({"cycle": i, **msgspec.structs.asdict(await settled_state())})
    elapsed = time.monotonic() - t0
    lat.sort()
    return {
        "cycles": cycles,
        "seconds": round(elapsed, 1),
        "cycles_per_s": round(cycles / elapsed, 2),
        "cycle_ms_median": round(lat[len(lat) // 2], 1),
        "cycle_ms_p90": round(lat[int(len(lat) * 0.9)], 1),
        "baseline": msgspec.structs.asdict(base),
        "trace": trace,
        "final": trace[-1],
    }
