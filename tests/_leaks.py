"""What a test run may have left behind: processes, mounts, cgroups and directories of its workspaces."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import psutil

from bunshin_async._host import _paths
from bunshin_async._host._kernel import CGROUP_ROOT, parent_name
from bunshin_async._host._snapstore import snapshot_dir


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _scan(ignore_children: set[int], host: bool) -> list[str]:
    found: list[str] = []
    for child in psutil.Process().children(recursive=True):
        if child.pid not in ignore_children:
            try:
                found.append(f"child {child.pid} {child.name()} {child.status()}")
            except psutil.NoSuchProcess:
                pass
    if not host:
        return found
    rundir = str(_paths.workspaces_dir())
    snaps = snapshot_dir()
    if snaps.exists():
        found += [f"snapshot {p}" for p in snaps.iterdir()]
    base = Path(rundir)
    if base.exists():
        found += [f"dir {p}" for p in base.iterdir()]
    for ctrl_dir in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()] if CGROUP_ROOT.exists() else []:
        parent = ctrl_dir / parent_name()
        if parent.is_dir():
            found += [f"cgroup {p}" for p in parent.iterdir() if p.is_dir()]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if rundir in line]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if rundir.encode() in cmdline:
            args = cmdline.replace(b"\0", b" ")[:120]
            found.append(f"process {pid} {args!r}")
    return found


async def leftovers(
    grace: float = 3.0,
    ignore_children: set[int] = frozenset(),  # type: ignore[assignment]
    host: bool = True,
) -> list[str]:
    """Leftovers still there after ``grace`` seconds (processes take a moment to be reaped): child processes not in
    ``ignore_children`` and, with ``host``, what this run's workspaces may leave (the run's directories, cgroup
    parent and snapshot store)."""
    with anyio.move_on_after(grace):
        while _scan(ignore_children, host):
            await anyio.sleep(0.02)
    return _scan(ignore_children, host)
