"""``bunshin gc``: remove what workspaces of a dead process left behind.

A workspace's processes die with the process that owns it (PR_SET_PDEATHSIG chains the kill), but a process killed
outright cannot remove its workspaces' directories and cgroups. Each workspace directory holds an ``owner`` file
(pid and start time, so a recycled pid is not mistaken for the owner); ``collect()`` removes the workspaces whose
owner is gone, then the snapshot layers (read-only overlay lowers) whose users are all gone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from . import _paths
from ._kernel import CGROUP_ROOT, parent_name


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def owner_token(pid: int) -> str:
    return f"{pid} {_start_time(pid)}"


def alive(token: str) -> bool:
    try:
        pid_s, start = token.split()
        return _start_time(int(pid_s)) == start
    except ValueError:
        return False


def _cgroup_dirs(name: str) -> list[Path]:
    dirs = [CGROUP_ROOT / parent_name() / name]
    if CGROUP_ROOT.exists():
        dirs += [d / parent_name() / name for d in CGROUP_ROOT.iterdir() if d.is_dir()]
    return [d for d in dirs if d.is_dir()]


def collect() -> list[str]:
    """Remove abandoned workspaces (blocking); returns a line per thing removed or kept."""
    from ._kernel import Cgroup

    out = []
    base = _paths.workspaces_dir()
    for ws_dir in sorted(base.iterdir()) if base.exists() else []:
        if ws_dir.name.startswith("."):  # .layers: collect_layers
            continue
        owner = ws_dir / "owner"
        token = owner.read_text().strip() if owner.exists() else ""
        if token and alive(token):
            out.append(f"kept {ws_dir.name} (owner {token.split()[0]} is alive)")
            continue
        cgroup = Cgroup(1, _cgroup_dirs(f"ws-{ws_dir.name}"))
        cgroup.destroy_sync()
        shutil.rmtree(ws_dir, ignore_errors=True)
        out.append(f"removed {ws_dir.name}")
    from ._fork import collect_layers

    return out + collect_layers()
