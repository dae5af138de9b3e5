"""Test runs sharing the machine: each host run has its own run dir, snapshot store and cgroup parent, named by its
pid (conftest's ``host_run``), and an owner file beside each directory (``<dir>.owner``: pid and start time, as a
workspace's ``owner``). A run killed outright (SIGKILL, the OOM killer) removes none of them, and none is within
``bunshin gc``'s reach (it collects the default run dir): the next host run's start removes those of runs proven dead
(``reclaim_dead_runs``), never a live run's."""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

from bunshin_async._host import _tree
from bunshin_async._host._dirlock import lock_dir
from bunshin_async._host._kernel import (
    CGROUP_ROOT,
    Cgroup,
    alive,
    cgroup_version,
    detach_mounts,
    owner_token,
    read_token,
)

RUN_PREFIX, SNAP_PREFIX, CGROUP_PREFIX = "bunshin-test-", "bunshin-snap-test-", "bunshin-test-"
_DIR = re.compile(r"bunshin-(?:snap-)?test-(\d+)-[^/]+")
_OWNER = re.compile(r"(bunshin-(?:snap-)?test-(\d+)-[^/]+?)\.owner(?:-part)?")
_CGROUP = re.compile(r"bunshin-test-(\d+)")


def run_bases() -> list[Path]:
    """Where runs make their directories: the run dir in the temporary directory, the snapshot store in /dev/shm."""
    return [Path(tempfile.gettempdir()), Path("/dev/shm")]


def owner_file(path: Path) -> Path:
    return path.with_name(path.name + ".owner")


def claim(path: Path) -> None:
    """Name this process the owner of a run's directory ``path`` (written whole by a rename: never read half)."""
    part = path.with_name(path.name + ".owner-part")
    part.write_text(owner_token(os.getpid()))
    part.rename(owner_file(path))


def _live(path: Path, pid: int) -> bool:
    """Whether the run that made ``path`` may be alive: its owner file names a live process, or there is none yet
    (the run is between making the directory and claiming it) and ``pid`` exists. A recycled pid only delays the
    collection of a run that died before its claim; it never makes a live run's directory look dead."""
    token = read_token(owner_file(path))
    return alive(token) if token is not None else os.path.exists(f"/proc/{pid}")


def _dirs(bases: list[Path]) -> list[tuple[int, Path]]:
    found = []
    for base in bases:
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            match = _DIR.fullmatch(d.name)
            if match and d.is_dir() and not d.is_symlink():
                found.append((int(match.group(1)), d))
    return found


def reclaim_dead_runs(
    bases: list[Path] | None = None, cgroup_root: Path = CGROUP_ROOT, *, starting: int | None = None
) -> list[str]:
    """Remove what dead test runs left (blocking): their directories (each locked exclusively meanwhile, so two
    starting runs never remove one tree at once) with the mounts at or below them (the snapshot store's tmpfs, the
    workspaces' disks), their owner files, and their cgroup parents (thawed, emptied, removed bottom-up). A run
    with a live directory, or whose pid lives, keeps its cgroups, but for ``starting``, the pid of the run calling
    this before it made anything: a cgroup parent of its pid is a dead run's that had the same pid. A line per
    thing removed."""
    bases = run_bases() if bases is None else bases
    out: list[str] = []
    runs = _dirs(bases)
    alive_dirs = {d for pid, d in runs if _live(d, pid)}
    live = {pid for pid, d in runs if d in alive_dirs}
    for _, d in runs:
        if d in alive_dirs:
            continue
        lock = lock_dir(d, exclusive=True, wait=False)
        if lock is None:  # another run's start is removing it
            continue
        try:
            out += detach_mounts(d)
            _tree.discard(d)
            out.append(f"removed {d}")
        finally:
            os.close(lock)
        owner_file(d).unlink(missing_ok=True)
    for base in bases:  # owner files of a run that removed its directory and died before its owner file
        for f in sorted(base.iterdir()) if base.is_dir() else []:
            match = _OWNER.fullmatch(f.name)
            d = base / match.group(1) if match else None
            if match and d is not None and not d.exists() and not _live(d, int(match.group(2))):
                f.unlink(missing_ok=True)
    for hierarchy in cgroup_roots(cgroup_root):  # v1: one per controller (a comounted one twice, by its symlinks)
        for top in sorted(hierarchy.iterdir()) if hierarchy.is_dir() else []:
            match = _CGROUP.fullmatch(top.name)
            # ``live`` is what the directories showed before their removal, which may take seconds: a run started
            # since has its cgroup parent and no directory in that listing; its pid, alive now, keeps it (a recycled
            # pid only delays the collection)
            pid = int(match.group(1)) if match else 0
            gone = pid == starting or (pid not in live and not os.path.exists(f"/proc/{pid}"))
            if match and gone and top.is_dir():
                tree = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
                if all(remove_cgroup(cg) for cg in [*tree, top]):
                    out.append(f"removed cgroup {top}")
    return out


def remove_cgroup(d: Path) -> bool:
    """Thaw ``d`` (a frozen v1 task does not die of SIGKILL), kill its tasks and remove it, waiting up to 5 s for
    them to exit; whether it is gone."""
    group = Cgroup(cgroup_version() or 1, [d])
    group.thaw()
    deadline = time.monotonic() + 5
    while group.dirs and time.monotonic() < deadline:
        group.destroy_sync()
        if group.dirs:
            time.sleep(0.01)
    return not group.dirs


def things_of(pid: int, cgroup_root: Path = CGROUP_ROOT) -> set[str]:
    """Cgroups (top level of each hierarchy), mounts and directories (/tmp, /var/tmp, /dev/shm) named bunshin*
    whose name holds ``pid`` (``-<pid>-`` or a trailing ``-<pid>``): what the test run of that pid could have made."""
    mine = re.compile(rf"/bunshin[^/]*-{pid}(?:-[^/]*)?(?:/|$)")
    tops = [*cgroup_roots(cgroup_root), Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")]
    found = {f"dir {d}" for top in tops if top.is_dir() for d in top.iterdir() if mine.search(str(d))}
    with open("/proc/self/mountinfo") as f:
        found |= {f"mount {point}" for line in f if mine.search(point := line.split()[4])}
    return found


def cgroup_roots(cgroup_root: Path = CGROUP_ROOT) -> list[Path]:
    """The cgroup root and each hierarchy below it (v1: one per controller)."""
    return [cgroup_root, *(d for d in cgroup_root.iterdir() if d.is_dir())] if cgroup_root.is_dir() else []
