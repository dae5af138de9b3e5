"""``bunshin gc``: remove what workspaces of a dead process left behind.

A workspace's processes die with the process that owns it (PR_SET_PDEATHSIG chains the kill), but a process killed
outright cannot remove its workspaces' directories and cgroups. Each workspace directory holds an ``owner`` file
(pid and start time, so a recycled pid is not mistaken for the owner); ``collect()`` removes the workspaces whose
owner is gone, then the snapshot layers (read-only overlay lowers) whose users are all gone, then the image layers
that no imported image names and no live workspace mounts (``_layers.LayerStore.collect``).

A process killed during a dump can leave its workspace's freezer cgroup frozen, and frozen tasks do not die of
SIGKILL until thawed (cgroup-v1 freezer): the cgroup is thawed before its tasks are killed. Mounts in this mount
namespace under the run dir or inside the snapshot store that belong to nothing alive (the SDK makes none there
itself: overlays are mounted in private mount namespaces, but a killed tool or an older version may have left
some) are detached. The snapshot store's own tmpfs stays mounted by design (host configuration, like a sysctl;
``bunshin snapstore``). Workspaces of a run scope (``_accounting.accounting_scope``: a parent cgroup of its own
below the workspaces' one) are found there too, and an empty scope whose process is gone is removed. Every line of
the report says what was removed, unmounted or kept, and why.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .._host import _paths, _tree
from .._host._kernel import CGROUP_ROOT, Cgroup, alive, cgroup_version, parent_name
from .._host._snapstore import collect_layers, snapshot_dir
from .._host._userns import collect as collect_shifted
from .._images._layers import LayerStore, mounted_lower_dirs


def _parents() -> list[Path]:
    """The workspaces' parent cgroup in every hierarchy that has it."""
    bases = [CGROUP_ROOT, *(d for d in CGROUP_ROOT.iterdir() if d.is_dir())] if CGROUP_ROOT.exists() else []
    return [b / parent_name() for b in bases if (b / parent_name()).is_dir()]


def _scopes(parent: Path) -> list[Path]:
    """The run scopes under a parent (``accounting_scope``: ``<label>-<pid>-<n>``, its workspaces inside)."""
    return [d for d in parent.iterdir() if d.is_dir() and _SCOPE.search(d.name) and not d.name.startswith("ws-")]


_SCOPE = re.compile(r"-(\d+)-\d+$")


def _cgroup(name: str) -> Cgroup:
    """The cgroup ``name`` under the workspaces' parent or one of its run scopes, in every hierarchy it is in."""
    dirs = [d / name for p in _parents() for d in (p, *_scopes(p))]
    return Cgroup(cgroup_version() or 1, [d for d in dirs if d.is_dir()])


def _stale_scopes() -> list[str]:
    """Remove the empty run scopes whose process is gone (blocking); a line per scope removed."""
    out = set()
    for parent in _parents():
        for d in _scopes(parent):
            match = _SCOPE.search(d.name)
            if match and not os.path.exists(f"/proc/{match.group(1)}"):
                try:
                    d.rmdir()
                    out.add(f"removed cgroup scope {d.name}")
                except OSError:  # still holds cgroups (busy), or gone
                    pass
    return sorted(out)


def _mounts_under(bases: list[Path]) -> list[str]:
    """Mount points in this mount namespace strictly below one of ``bases``, deepest first (proc(5)
    mountinfo: the 5th field, with octal escapes)."""
    found = []
    prefixes = [f"{b.resolve()}/" for b in bases]
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point.startswith(p) for p in prefixes):
                found.append(point)
    return sorted(set(found), key=lambda p: -p.count("/"))


def unmount_stale(keep: set[str]) -> list[str]:
    """Detach the mounts below the run dir and inside the snapshot store (blocking), except those below a path in
    ``keep`` (workspaces and snapshots still owned by a live process)."""
    from .. import _native  # the C extension, loaded when first needed (as in _kernel)

    out = []
    for point in _mounts_under([_paths.workspaces_dir(), snapshot_dir()]):
        if any(point == k or point.startswith(k + "/") for k in keep):
            continue
        try:
            _native.umount2(point, _native.MNT_DETACH)
            out.append(f"unmounted {point}")
        except OSError as exc:
            out.append(f"could not unmount {point}: {os.strerror(exc.errno or 0)}")
    return out


def _orphan_cgroups(base: Path) -> list[str]:
    names: set[str] = set()
    for parent in _parents():
        for d in (parent, *_scopes(parent)):
            names |= {w.name for w in d.iterdir() if w.is_dir() and w.name.startswith("ws-")}
    return sorted(n for n in names if not (base / n[3:]).exists())


def collect() -> list[str]:
    """Remove abandoned workspaces (blocking); returns a line per thing removed, unmounted or kept."""
    out = []
    keep: set[str] = set()
    base = _paths.workspaces_dir()
    for ws_dir in sorted(base.iterdir()) if base.exists() else []:
        if ws_dir.name.startswith("."):  # .layers: collect_layers
            continue
        owner = ws_dir / "owner"
        token = owner.read_text().strip() if owner.exists() else ""
        if token and alive(token):
            out.append(f"kept {ws_dir.name} (owner {token.split()[0]} is alive)")
            keep.add(str(ws_dir.resolve()))
            continue
        cgroup = _cgroup(f"ws-{ws_dir.name}")
        cgroup.thaw()
        cgroup.destroy_sync()
        out += unmount_stale(keep | {str(p.resolve()) for p in base.iterdir() if p != ws_dir})
        _tree.discard(ws_dir)
        out.append(f"removed {ws_dir.name}" + (f" (cgroup left: {cgroup.dirs[0]})" if cgroup.dirs else ""))
    for name in _orphan_cgroups(base):  # a workspace killed between its cgroup and its directory
        orphan = _cgroup(name)
        orphan.thaw()
        orphan.destroy_sync()
        out.append(f"removed cgroup {name}" + (" (busy)" if orphan.dirs else ""))
    out += _stale_scopes() + collect_layers() + LayerStore().collect()
    # the built-in images' and agent layers' shifted copies (a store layer's go with the layer)
    parents = [p for d in (_paths.images_dir(), _paths.agent_layers_dir()) if d.is_dir() for p in d.iterdir()]
    out += collect_shifted([p for p in parents if p.is_dir()], mounted_lower_dirs())
    live_snaps = {str((snapshot_dir() / line.split()[2]).resolve()) for line in out if line.startswith("kept snap")}
    return out + unmount_stale(keep | live_snaps | {str(base.resolve() / ".layers")})
