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

``reclaim()`` is the part a process's first workspace start does by itself, beside other live processes: only what
is proven dead (see its doc). Two collections never run at once, and neither sees a workspace or snapshot another
process is making before its owner or users are written: a collection holds the run dir's and the snapshot store's
locks exclusively, the makers shared (``_host._dirlock``), so ``bunshin gc`` is safe beside running processes too.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

import anyio

from .._config import Config
from .._host import _paths, _tree
from .._host._dirlock import lock_dir
from .._host._kernel import (
    CGROUP_ROOT,
    Cgroup,
    alive,
    cgroup_version,
    detach_mounts,
    mounts_at,
    parent_name,
    read_token,
)
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
    """Mount points in this mount namespace strictly below one of ``bases``, deepest first."""
    found = {point for b in bases for point in mounts_at(b, below_only=True)}
    return sorted(found, key=lambda p: -p.count("/"))


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


def _locked(base: Path, wait: bool) -> int | None:
    """An exclusive lock on the run dir (``_dirlock``): two collections never work on one workspace, and none sees
    a workspace directory another process is making before its owner file (``WorkspaceCore.made_dirs`` holds it
    shared meanwhile); the descriptor holds it (close it to let go). None without the directory, or when ``wait`` is
    false and another process holds it."""
    return lock_dir(base, exclusive=True, wait=wait)


def _remove_dir(ws_dir: Path, cgroup: Cgroup) -> list[str]:
    """Remove a dead owner's workspace directory, its cgroup already destroyed (blocking): its mounts, then its tree
    (from descriptors, nothing in it followed)."""
    out = detach_mounts(ws_dir)  # its Limits.disk tmpfs
    _tree.discard(ws_dir)
    return [*out, f"removed {ws_dir.name}" + (f" (cgroup left: {cgroup.dirs[0]})" if cgroup.dirs else "")]


def collect() -> list[str]:
    """Remove abandoned workspaces (blocking); returns a line per thing removed, unmounted or kept."""
    base = _paths.workspaces_dir()
    lock = _locked(base, wait=True)
    try:
        return _collect_all(base)
    finally:
        if lock is not None:
            os.close(lock)


def _collect_all(base: Path) -> list[str]:
    out = []
    keep: set[str] = set()
    for ws_dir in sorted(base.iterdir()) if base.exists() else []:
        if ws_dir.name.startswith("."):  # .layers: collect_layers
            continue
        token = read_token(ws_dir / "owner") or ""
        if token and alive(token):
            out.append(f"kept {ws_dir.name} (owner {token.split()[0]} is alive)")
            keep.add(str(ws_dir.resolve()))
            continue
        cgroup = _cgroup(f"ws-{ws_dir.name}")
        cgroup.thaw()
        cgroup.destroy_sync()
        out += _remove_dir(ws_dir, cgroup)
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


_WS_ID = re.compile(r"[0-9a-f]{12}")  # a workspace's directory (``WorkspaceCore``: token_hex(6))
_reclaimed: set[tuple[Path, Path, str]] = set()
log = logging.getLogger("bunshin_async.workspace")


async def reclaim() -> list[str]:
    """What dead processes left, collected by a process's first workspace start (``Workspace.start``; once per
    run dir, snapshot store and cgroup parent, those of the process, not of a run's scope): a process killed
    outright (SIGKILL, SIGTERM without a handler, the OOM killer) cannot remove its workspaces, and ``bunshin gc``
    is easy to forget. Unlike ``bunshin gc`` it only takes what is proven dead: a workspace whose ``owner`` names a
    process that is gone, or that has no owner file (its maker was killed while making it: ``_abandoned``), its
    cgroup (thawed first) and mounts, the empty run scopes of dead processes, and the layers and snapshot
    directories whose users are all dead (``collect_layers(proven=True)``). Another process collecting (or making
    a workspace) meanwhile: skipped.
    Returns a line per thing removed; a warning says how many workspaces were."""
    config = Config.process()
    key = (config.run_dir, config.snapshot_dir, config.cgroup_parent)
    if key in _reclaimed:
        return []
    _reclaimed.add(key)
    with Config.scoped(run_dir=config.run_dir, snapshot_dir=config.snapshot_dir, cgroup_parent=config.cgroup_parent):
        base = _paths.workspaces_dir()
        lock = await anyio.to_thread.run_sync(_locked, base, False)
        if lock is None:
            return []
        try:
            out = await _reclaim(base)
        except OSError as exc:  # another process removed something meanwhile: the next process goes on
            out = [f"stopped: {exc}"]
        finally:
            os.close(lock)
    removed = [line for line in out if line.startswith("removed ") and _WS_ID.fullmatch(line.split()[1])]
    if removed:
        log.warning("collected %d workspaces left by dead processes (%s)", len(removed), "; ".join(out))
    return out


def _abandoned(ws_dir: Path) -> bool:
    """Whether a workspace directory is proven dead, the run dir's lock held exclusively (no process is making one
    meanwhile: ``make_dirs`` holds it shared from the directory to its owner file): its owner is gone, or it has
    none, or an empty one (its maker was killed before it wrote the owner file whole), unless its cgroup has tasks:
    the owner file is on the workspace's disk, a tmpfs mounted on the directory, which a process in another mount
    namespace sharing the run dir mounted where this one sees only the empty directory (a maker killed in
    ``make_dirs`` made no cgroup yet). An owner file that is not a regular file (a symlink is not followed) is no
    proof: kept."""
    owner = ws_dir / "owner"
    try:
        st = owner.lstat()
    except FileNotFoundError:
        return not _cgroup(f"ws-{ws_dir.name}").pids()
    except OSError:
        return False
    if stat.S_ISREG(st.st_mode) and st.st_size == 0:
        return not _cgroup(f"ws-{ws_dir.name}").pids()
    token = read_token(owner)
    return token is not None and not alive(token)


async def _reclaim(base: Path) -> list[str]:
    def dead() -> list[Path]:
        out = []
        for ws_dir in sorted(base.iterdir()):
            if _WS_ID.fullmatch(ws_dir.name) and _abandoned(ws_dir):
                out.append(ws_dir)
        return out

    out: list[str] = []
    for ws_dir in await anyio.to_thread.run_sync(dead):
        cgroup = await anyio.to_thread.run_sync(_cgroup, f"ws-{ws_dir.name}")
        cgroup.thaw()  # a frozen task does not die of SIGKILL (cgroup-v1 freezer)
        await cgroup.destroy()
        out += await anyio.to_thread.run_sync(_remove_dir, ws_dir, cgroup)
    return out + await anyio.to_thread.run_sync(lambda: _stale_scopes() + collect_layers(proven=True))
