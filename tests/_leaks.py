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


def criu_roots() -> set[Path]:
    """CRIU's mount roots directories in /tmp (``.criu.mntns.XXXXXX``, mount.c ``create_mnt_roots``), which a failed
    or killed restore left there: Bunshin's restores make theirs on a tmpfs of their own mount namespace
    (``bunshin-init --mnt-roots``, criu/patches/0037), so none may appear."""
    return set(Path("/tmp").glob(".criu.mntns.*"))


def new_criu_roots(before: set[Path]) -> list[str]:
    """The CRIU mount roots made since ``before`` was taken, when no other SDK process runs on the host: nothing
    says whose one is, and another's (a checkout older than the wrapper's tmpfs) makes them as its restores run and
    fail. A CRIU not started by an SDK is not seen here."""
    new = criu_roots() - before
    if not new or _other_sdks():
        return []
    return [f"criu mount roots {p}" for p in sorted(new)]


def _other_sdks() -> bool:
    """Whether a process outside this one's tree has Bunshin's native module mapped (a test run, a benchmark, a
    script): blocking, a read of every process's maps."""
    me = psutil.Process()
    ours = {me.pid, *(p.pid for p in me.children(recursive=True))}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in ours:
            continue
        try:
            if b"bunshin_async/_native" in Path(f"/proc/{pid}/maps").read_bytes():
                return True
        except OSError:
            continue
    return False


def _scan(ignore_children: set[int], host: bool, roots: set[Path] | None = None) -> list[str]:
    found: list[str] = []
    for child in psutil.Process().children(recursive=True):
        if child.pid not in ignore_children:
            try:
                found.append(f"child {child.pid} {child.name()} {child.status()}")
            except psutil.NoSuchProcess:
                pass
    if not host:
        return found
    if roots is not None:
        found += new_criu_roots(roots)
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
    criu_roots_before: set[Path] | None = None,
) -> list[str]:
    """Leftovers still there after ``grace`` seconds (processes take a moment to be reaped): child processes not in
    ``ignore_children`` and, with ``host``, what this run's workspaces may leave (the run's directories, cgroup
    parent and snapshot store) and, given the CRIU mount roots there were before, those made since
    (``new_criu_roots``)."""
    with anyio.move_on_after(grace):
        while _scan(ignore_children, host, criu_roots_before):
            await anyio.sleep(0.02)
    return _scan(ignore_children, host, criu_roots_before)
