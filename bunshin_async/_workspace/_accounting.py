"""Memory and CPU accounting by the kernel's own counters, over everything a run creates.

A run (an experiment's configuration, a user's batch of rollout groups) is measured whole by giving it a subtree
of its own (``accounting_scope``): one cgroup parent under which every workspace it creates lives (its bases, copies,
speculative branches, restored cache hits, warm spares, everything made by ``Workspace`` while the scope is in
force, in this task and the tasks and threads it starts) and one snapshot directory for every snapshot it takes.
``Subtree.read()`` then reads, with no list of objects anyone has to remember:

- memory: the summed PSS of every process in every cgroup of the subtree (shared pages divided among their sharers,
  so copy-on-write copies are not counted twice), plus what PSS cannot see: the page images that copy-on-write
  copies map (resident in full on tmpfs, unlinked or not, however few pages were touched), the bytes of the
  run's snapshot directory (a tmpfs of its own: the kernel's count, no walk), and what each of its workspaces wrote
  (its upper dir, on a tmpfs of its own: files no process maps are in no PSS) (``memory_bytes``);
- CPU: the subtree's own CPU counter (v1 ``cpuacct.usage``, v2 ``cpu.stat``): exact, hierarchical, and it keeps what
  processes and cgroups that are gone were charged.

``ResourceMonitor`` samples a subtree (or, without one, the workspaces it was told to ``track``) every ``interval``
seconds and reports the peak, the integral over time (GiB-seconds: "total memory consumption") and the CPU seconds.

One reader per kernel figure serves the whole package: PSS (``pss_bytes``), copy-on-write page images
(``mapped_image_bytes``), file bytes (``tree_bytes``, a walk), a run's snapshot directory (``stored_bytes``) and a
workspace's upper dir (``written_bytes``), each its tmpfs's own count, here; a cgroup's own counters
(``Cgroup.cpu_seconds``, ``memory_usage``, ``memory_peak``) in ``_kernel``.

    with accounting_scope("my-run") as subtree:                  # sync: set-up and removal are a few mkdir/rmdir
        async with ResourceMonitor(subtree=subtree) as monitor:
            ...                                         # create and run workspaces
        report = monitor.report()                       # peak_bytes, gib_seconds, cpu_seconds
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING

import anyio
import msgspec

from .._config import Config
from .._exceptions import CapabilityMissing
from .._host import _kernel, _snapstore, _tree
from .._host._snapstore import prepare_snapshot_store

if TYPE_CHECKING:
    from ._facade import Workspace

__all__ = [
    "MemoryReport",
    "MemorySample",
    "ResourceMonitor",
    "Subtree",
    "Usage",
    "mapped_image_bytes",
    "pss_bytes",
    "rollup_bytes",
    "stored_bytes",
    "accounting_scope",
    "byte_seconds_net",
    "held_memory",
    "tree_bytes",
    "workspace_memory",
    "written_bytes",
]


class MemorySample(msgspec.Struct, frozen=True, array_like=True):
    """One sample: memory is ``pss_bytes + extra_bytes``."""

    t: float  # seconds since the monitor started
    pss_bytes: int
    extra_bytes: int  # snapshots, copy-on-write page images and workspaces' upper dirs, beyond what PSS shows
    workspaces: int  # cgroups in the subtree (or workspaces tracked)
    cpu_seconds: float = 0.0  # CPU charged since the monitor started (the subtree's counter; tracked: alive only)


class MemoryReport(msgspec.Struct, frozen=True):
    """What a ``ResourceMonitor`` saw: ``peak_bytes`` (the largest sample), ``gib_seconds`` (memory integrated over
    the run), ``cpu_seconds`` (charged during it), ``duration`` and ``interval`` in seconds, and every sample."""

    interval: float
    duration: float
    peak_bytes: int
    gib_seconds: float
    cpu_seconds: float
    samples: list[MemorySample]


class Usage(msgspec.Struct, frozen=True):
    """One reading of a subtree. Bytes now; ``cpu_seconds`` cumulative since the subtree's parent was made (None
    without CPU accounting)."""

    pss_bytes: int
    image_bytes: int  # page images its processes map copy-on-write, beyond their PSS
    snapshot_bytes: int  # in its snapshot directory, not counting the images above again
    cpu_seconds: float | None
    processes: int
    cgroups: int
    upper_bytes: int = 0  # what its workspaces wrote (``written_bytes`` of each), the images above not again

    @property
    def memory_bytes(self) -> int:
        return self.pss_bytes + self.image_bytes + self.snapshot_bytes + self.upper_bytes


def rollup_bytes(pids: Iterable[int], *fields: str) -> int:
    """The sum over ``pids`` of the /proc/PID/smaps_rollup lines named ``fields`` (``"Pss"``, ``"Private_Dirty"``,
    ...), in bytes; a process gone meanwhile counts 0. Blocking."""
    names = {f.encode() + b":" for f in fields}
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.split(None, 1)[0] in names:
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    return total


def pss_bytes(pids: Iterable[int]) -> int:
    """Summed proportional set size of ``pids`` (shared pages divided among their sharers). Blocking."""
    return rollup_bytes(pids, "Pss")


def mapped_image_bytes(pids: Iterable[int], marker: bytes = b"/pages-") -> tuple[int, set[tuple[int, int]]]:
    """Memory held by page-image files that ``pids`` map copy-on-write and that PSS does not show.

    A copy-on-write restore maps its CRIU page image (a tmpfs file, often already unlinked) MAP_PRIVATE: the whole
    file stays in RAM while any copy maps it, but PSS only counts the pages a process has touched. For each such
    file (by inode) this returns its size minus the PSS of every mapping of it (so no page is counted twice), and
    the inodes seen, so that a caller also walking the snapshot directory can skip them. Blocking."""
    sizes, pss = _mapped_images(pids, marker)
    return sum(max(0, sizes[k] - pss.get(k, 0)) for k in sizes), set(sizes)


def _mapped_images(
    pids: Iterable[int], marker: bytes = b"/pages-"
) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """``mapped_image_bytes``'s reading: each mapped page image's bytes and the PSS of its mappings, by (dev, ino).
    Only the processes whose /proc/PID/maps names a page image have their smaps read: maps lists the mappings
    without walking a page table (smaps walks them all: ~2 ms a sample for a run's few dozen processes), and an
    smaps header line is its maps line, so the figures are the same."""
    sizes: dict[tuple[int, int], int] = {}
    pss: dict[tuple[int, int], int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                maps = f.read()
            if marker not in maps or b".img" not in maps:
                continue
            with open(f"/proc/{pid}/smaps", "rb") as f:
                key: tuple[int, int] | None = None
                for line in f:
                    if line[:1].isdigit() or line[:1] in b"abcdef":
                        fields = line.split(None, 5)
                        key = None
                        if len(fields) == 6 and marker in fields[5] and b".img" in fields[5]:
                            major, minor = (int(x, 16) for x in fields[3].split(b":"))
                            key = (os.makedev(major, minor), int(fields[4]))
                            if key not in sizes:
                                # maps pads addresses to 8 digits, map_files names them without leading zeros
                                lo, hi = (int(x, 16) for x in fields[0].split(b"-"))
                                # what the file holds (st_blocks), not its size: the name is no proof (a workspace
                                # may map a sparse 1 TiB file of its own named pages-1.img); a page image is written
                                # whole, so its blocks are its size
                                try:
                                    st = os.stat(f"/proc/{pid}/map_files/{lo:x}-{hi:x}")
                                    sizes[key] = st.st_blocks * 512
                                except OSError:
                                    sizes[key] = 0
                    elif key is not None and line.startswith(b"Pss:"):
                        pss[key] = pss.get(key, 0) + int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
    return sizes, pss


def tree_bytes(path: Path, skip: set[tuple[int, int]] = frozenset()) -> int:  # type: ignore[assignment]
    """Allocated bytes of the files under ``path`` (st_blocks, so sparse files count what they hold). Blocking."""
    total = 0
    try:
        for e in _tree.walk(path):  # a workspace's tree: from descriptors, any depth, nothing followed
            st = e.st
            if not stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) not in skip:
                total += st.st_blocks * 512
    except OSError:  # gone, or changing under a live workspace: what was counted
        pass
    return total


def workspace_memory(ws: Workspace) -> int:
    """The memory one running workspace holds, as a subtree reading counts it: its processes' PSS, the page images
    they map copy-on-write (its cgroup is not charged for them, so a restored copy's cgroup peak can be a tenth of
    what it holds) and its private upper dir (``written_bytes``: on tmpfs when ``Limits.disk`` is set; written pages
    either way). Blocking; no walk of the workspace's tree with a ``Limits.disk`` (the default): cheap enough for
    every slow write's capture rule."""
    return held_memory([ws])


def held_memory(workspaces: Iterable[Workspace], dirs: Iterable[Path] = ()) -> int:
    """The memory ``workspaces`` hold together (each as ``workspace_memory`` counts it, a page image mapped by
    several counted once) plus the bytes of ``dirs`` (a snapshot store, walked) not counted already: what a host
    holding them holds, without a subtree of its own. Blocking."""
    held = list(workspaces)
    pids = [pid for ws in held if ws.cgroup is not None for pid in ws.cgroup.pids()]
    return pss_bytes(pids) + sum(_beyond_pss(pids, [ws.directory for ws in held], dirs))


def _beyond_pss(pids: Iterable[int], uppers: Iterable[Path], dirs: Iterable[Path]) -> tuple[int, int, int]:
    """What ``pids``' PSS does not show: (the page images they map, beyond the PSS of those mappings; the bytes of
    ``dirs`` not counted as images (``stored_bytes``); the upper dirs of the workspaces whose host directories are
    ``uppers``, images not again). One reading serves a subtree, a tracked set and a host's workspaces alike.
    Blocking."""
    sizes, pss = _mapped_images(pids)
    images = sum(max(0, sizes[k] - pss.get(k, 0)) for k in sizes)
    files = sum(stored_bytes(d, sizes) for d in dirs)
    return images, files, sum(written_bytes(d, sizes) for d in uppers)


def _own_fs_used(fd: int, directory: Path, images: Mapping[tuple[int, int], int]) -> int | None:
    """The bytes the filesystem mounted on ``directory`` (open as ``fd``) holds, less the page images of
    ``images`` that live on it; None when ``directory`` is no mount of its own (or a tmpfs without a size: no
    count). tmpfs counts a file's allocated pages (its st_blocks), once per inode, unlinked files still open or
    mapped included (fstatvfs(2))."""
    st = os.fstat(fd)
    vfs = os.fstatvfs(fd)
    if st.st_dev == os.stat(directory.parent).st_dev or vfs.f_blocks == 0:
        return None
    mapped = sum(size for (dev, _ino), size in images.items() if dev == st.st_dev)
    return (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize - mapped


def stored_bytes(directory: Path, images: Mapping[tuple[int, int], int] = MappingProxyType({})) -> int:
    """The bytes of the files under ``directory`` (a run's snapshot directory), the page images named in ``images``
    ((dev, ino) -> bytes, ``_mapped_images``: counted as such) left out. When ``directory`` is a tmpfs of its own
    (``accounting_scope`` mounts one) the kernel keeps the figure: no walk, whatever the store holds (a reading
    every 0.1 s must not cost what it measures, nor grow with it); a file hard-linked twice counts once, as it is
    held. Otherwise it is walked (``tree_bytes``). Blocking; a directory that is gone holds nothing."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        used = _own_fs_used(fd, directory, images)
    finally:
        os.close(fd)
    return max(0, used) if used is not None else tree_bytes(directory, set(images))


def written_bytes(directory: Path, images: Mapping[tuple[int, int], int] = MappingProxyType({})) -> int:
    """The bytes in the upper dir of the workspace whose host directory is ``directory`` (what it wrote), the page
    images named in ``images`` ((dev, ino) -> bytes, ``_mapped_images``: counted as such) left out.

    With ``Limits.disk`` (the default) ``directory`` is a tmpfs of the workspace's own, and the kernel keeps the
    figure: the pages it holds (fstatvfs; tmpfs counts a file's allocated pages, as its st_blocks do), less the
    host's few files beside the upper (``owner``, CRIU's ``restore.log``): no walk, whatever the upper's size (a
    walk of a 100k-file tree takes seconds). Files hard-linked in the upper count once (they are held once). The
    overlay's work dir holds nothing between operations but the copy-up under way, which counts (it is being
    written). Without a disk of its own (``Limits(disk=None)``: unbounded, on the host's filesystem, logged at
    creation) or once it is unmounted, the upper is walked. Blocking."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone: nothing held
        return 0
    try:
        used = _own_fs_used(fd, directory, images)
        if used is None:  # the directory as it is on the parent's filesystem: what is there is its upper
            upper = directory / "upper"
            return tree_bytes(upper, set(images)) if upper.exists() else 0
        beside = 0  # the host's files at the top (the workspace writes below upper/ only)
        with os.scandir(fd) as entries:
            for e in entries:
                try:
                    if not e.is_dir(follow_symlinks=False):
                        beside += e.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    pass
        return max(0, used - beside)
    finally:
        os.close(fd)


def byte_seconds_net(
    uses: float, seconds_saved: float, freed_bytes: float, held_bytes: float, hold_seconds: float, weight: float = 1.0
) -> float:
    """What keeping something pays in a run's memory currency (byte-seconds; GiB·s over 2**30): ``uses`` expected
    users each finish ``seconds_saved`` sooner, so their ``freed_bytes`` are freed that much earlier, against
    ``held_bytes`` kept for ``hold_seconds`` (times ``weight``), used or not. Negative: keeping it cannot pay.
    The one cost model of everything kept for later: a speculative fork (``speculator.CostAwarePolicy``), a
    tool-cache capture (``ToolCache(weigh_captures=True)``), a branch kept for the next turn."""
    return uses * seconds_saved * freed_bytes - held_bytes * hold_seconds * weight


COUNTED = ("memory", "cpuacct")
"""The v1 hierarchies a reading walks: every process of a subtree is in one of them. A workspace's processes join
the memory hierarchy first (``Cgroup.create``'s order, kept by every join: ``native/init.c``'s ``attach_tree`` and
``--restore-wrap``) and a host helper working for the run joins cpuacct alone (``Cgroup.make_cpu_account``: CRIU's
dump); the CPU counter is cpuacct's. The other hierarchies hold the same processes again: walking them (each cgroup
directory listed, each ``cgroup.procs`` read, six times over) cost more than reading the figures."""

_WS_CGROUP = re.compile(r"ws-([0-9a-f]{12})")  # a workspace's cgroup (``_core``: ``ws-`` + token_hex(6))


class Subtree:
    """The cgroups under one parent (``parent``, relative to each hierarchy, as ``Config.cgroup_parent``) and one
    snapshot directory: everything a run made, read by the kernel's counters (``read``). A workspace's upper dir is
    found by its cgroup's name (``ws-<id>``) in ``workspaces`` (the run dir, ``Config.run_dir`` when made): a
    workspace that is gone has neither. Blocking methods."""

    def __init__(self, parent: str, snapshot_dir: Path | None = None, workspaces: Path | None = None) -> None:
        self.parent = parent.strip("/")
        self.snapshot_dir = snapshot_dir
        self.workspaces = workspaces if workspaces is not None else Config.current().run_dir

    def __repr__(self) -> str:
        return f"Subtree({self.parent!r}, {self.snapshot_dir!r})"

    def roots(self, controllers: Iterable[str] = _kernel.V1_CONTROLLERS) -> list[Path]:
        """The parent's directory in each hierarchy that has it (v2: one; v1: one per mounted controller of
        ``controllers``)."""
        version = _kernel.cgroup_version()
        if version == 2:
            bases = [_kernel.CGROUP_ROOT]
        else:
            bases, seen = [], set()
            for ctrl in controllers:
                base = _kernel.CGROUP_ROOT / ctrl
                if (base / "cgroup.procs").exists() and (real := base.resolve()) not in seen:
                    seen.add(real)
                    bases.append(base)
        return [b / self.parent for b in bases if (b / self.parent).is_dir()]

    def cgroups(self, roots: list[Path] | None = None) -> list[Path]:
        """Every cgroup directory of the subtree, the parent's included, in every hierarchy (``roots``: ``roots()``
        already read)."""
        out: list[Path] = []
        for root in self.roots() if roots is None else roots:
            for d, subdirs, _files in os.walk(root):
                out.append(Path(d))
                subdirs.sort()
        return out

    def pids(self, cgroups: Iterable[Path] = ()) -> list[int]:
        """Every process in any cgroup of the subtree (in any hierarchy: a process joined to some only counts);
        ``cgroups``: a listing already made."""
        out: set[int] = set()
        for d in cgroups or self.cgroups():
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):  # removed meanwhile
                pass
        return sorted(out)

    def cpu_seconds(self, roots: list[Path] | None = None) -> float | None:
        """CPU time charged to the subtree since its parent was made, exited processes and removed cgroups included
        (cgroup v1 cpuacct charges every ancestor as it charges a task; v2 flushes a removed child into its
        parent); None without CPU accounting. ``roots``: ``roots()`` already read."""
        roots = self.roots() if roots is None else roots
        return _kernel.Cgroup(_kernel.cgroup_version() or 1, roots).cpu_seconds() if roots else None

    def workspace_ids(self, cgroups: Iterable[Path] = ()) -> set[str]:
        """The ids of the workspaces whose cgroups are in the subtree (``cgroups``: a listing already made)."""
        return {m[1] for d in (cgroups or self.cgroups()) if (m := _WS_CGROUP.fullmatch(d.name))}

    def read(self, extra_dirs: Iterable[Path] = ()) -> Usage:
        """Memory and CPU of the subtree now (``extra_dirs``: more directories whose bytes the run holds). The
        cgroups are listed once for all the figures, in the hierarchies that hold every process of the subtree
        (``COUNTED``); the snapshot directory is read from its own tmpfs's count (``stored_bytes``), not walked,
        when ``accounting_scope`` could mount one."""
        roots = self.roots(COUNTED) if (_kernel.CGROUP_ROOT / "memory" / "cgroup.procs").exists() else self.roots()
        cgroups = self.cgroups(roots)
        pids = self.pids(cgroups)
        uppers = [self.workspaces / i for i in sorted(self.workspace_ids(cgroups))]
        dirs = [d for d in (self.snapshot_dir, *extra_dirs) if d is not None]
        images, files, written = _beyond_pss(pids, uppers, dirs)
        return Usage(
            pss_bytes=pss_bytes(pids),
            image_bytes=images,
            snapshot_bytes=files,
            cpu_seconds=self.cpu_seconds(roots),
            processes=len(pids),
            cgroups=sum(1 for d in cgroups if d.is_relative_to(cgroups[0])) - 1 if cgroups else 0,  # not the parent
            upper_bytes=written,
        )

    def remove(self) -> list[Path]:
        """Remove the subtree's cgroup directories that are empty, deepest first; returns those left (busy).
        Blocking."""
        left = []
        for d in sorted(self.cgroups(), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # EBUSY: processes or child cgroups remain
                left.append(d)
        return left


_scopes = itertools.count()


@contextlib.contextmanager
def accounting_scope(label: str = "run") -> Iterator[Subtree]:
    """``with accounting_scope("fork+cache") as subtree:`` everything this task (and the tasks and threads it
    starts) creates meanwhile lives under a fresh cgroup parent ``<cgroup_parent>/<label>-<pid>-<n>`` and a fresh
    snapshot directory of the same name in the snapshot store (``Config.scoped``), which ``subtree`` reads. On exit,
    once the run's workspaces and snapshots are closed, both are removed; what is still busy stays (``bunshin gc``).

    Snapshots taken inside live in the scope's directory, a tmpfs of its own (as the snapshot store is, when the
    process may mount): use them inside (a copy restored outside the scope from one taken inside, or the reverse, is
    not counted here, and its first restore copies the snapshot's files instead of renaming them). Blocking set-up
    and removal (a few mkdir/rmdir, a mount)."""
    config = Config.current()
    name = f"{re.sub(r'[^A-Za-z0-9_.+-]', '-', label)[:40]}-{os.getpid()}-{next(_scopes)}"
    parent = f"{config.cgroup_parent.strip('/')}/{name}"
    snaps = config.snapshot_dir / name
    # gc: a snapshot directory without a live user is collectable; this process holds the run's while it runs
    # (made and held in one section of the store's lock: a collection elsewhere sees both or neither).
    users = config.snapshot_dir / f"{name}.users"
    with _snapstore.store_lock():
        snaps.mkdir(parents=True)
        _snapstore.hold_layers([snaps], "scope")
    subtree = Subtree(parent, snaps)
    try:
        _kernel.Cgroup.make_parent(parent)  # its counters start at zero now, before the run's first workspace
        with Config.scoped(cgroup_parent=parent, snapshot_dir=snaps):
            # A tmpfs of its own, as the store's (large folios): the run's snapshot bytes are then the kernel's count
            # (``stored_bytes``), read at every sample without walking what the run stored. Without the right to
            # mount, the first fork's check does what it can and the directory is walked.
            with contextlib.suppress(CapabilityMissing):
                prepare_snapshot_store()
            yield subtree
    finally:
        subtree.remove()
        _unmount_if_empty(snaps)
        try:
            snaps.rmdir()
        except OSError:  # snapshots outlive the scope: keep the directory held while this process lives
            pass
        else:
            with contextlib.suppress(OSError):
                (users / "scope").unlink()
                users.rmdir()


def _unmount_if_empty(snaps: Path) -> None:
    """The scope mounts a tmpfs with large folios on its snapshot directory (as ``_fork._modes`` does on a store
    configured on a plain directory); the scope made its directory, so such a mount is the run's. Once the run's
    snapshots are gone (nothing left in it but empty directories) it is unmounted; otherwise it stays with them
    (``bunshin gc`` unmounts it once this process is gone). Blocking."""
    if not os.path.ismount(snaps):
        return
    for d, _subdirs, files in os.walk(snaps, topdown=False):  # never follows a symlink
        if files or d == str(snaps):
            continue
        with contextlib.suppress(OSError):
            os.rmdir(d)
    if any(snaps.iterdir()):
        return
    from .. import _native  # the C extension, loaded when first needed

    with contextlib.suppress(OSError):
        _native.umount2(str(snaps), _native.MNT_DETACH)


def _cpu_seconds(pids: Iterable[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        except (OSError, ValueError, IndexError):
            pass
    return total / tick


class ResourceMonitor:
    """Samples memory and CPU in the background: ``async with ResourceMonitor(subtree=s) as mon:``, then
    ``mon.report()``. With a ``subtree`` (``accounting_scope``) it reads everything the run made, by the kernel's
    counters; ``track``/``untrack`` are then not needed and change nothing. Without one it samples the workspaces it
    was told to ``track`` (what they alone hold; CPU seconds of processes alive at a sample, a lower bound).
    ``extra_dirs``: more directories whose bytes count (e.g. a snapshot store shared with nothing else)."""

    def __init__(self, interval: float = 0.1, extra_dirs: Iterable[Path] = (), subtree: Subtree | None = None) -> None:
        self.interval = interval
        self.extra_dirs = list(extra_dirs)
        self.subtree = subtree
        self._workspaces: set[Workspace] = set()
        self._samples: list[MemorySample] = []
        self._cpu: dict[int, float] = {}
        self._cpu0: float | None = None
        self._t0 = 0.0
        self._t1: float | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    def track(self, ws: Workspace) -> None:
        self._workspaces.add(ws)

    def untrack(self, ws: Workspace) -> None:
        self._workspaces.discard(ws)

    def _sample(self) -> MemorySample:
        t = time.monotonic() - self._t0
        if self.subtree is not None:
            u = self.subtree.read(self.extra_dirs)
            t = (t + time.monotonic() - self._t0) / 2  # a reading takes a while on a busy machine: its middle
            cpu = 0.0
            if u.cpu_seconds is not None:
                if self._cpu0 is None:
                    self._cpu0 = u.cpu_seconds
                cpu = u.cpu_seconds - self._cpu0
            return MemorySample(t, u.pss_bytes, u.image_bytes + u.snapshot_bytes + u.upper_bytes, u.cgroups, cpu)
        tracked = list(self._workspaces)
        pids = [pid for ws in tracked if ws.cgroup is not None for pid in ws.cgroup.pids()]
        for pid in pids:
            self._cpu[pid] = _cpu_seconds([pid])
        extra = sum(_beyond_pss(pids, [ws.directory for ws in tracked], self.extra_dirs))
        return MemorySample(t, pss_bytes(pids), extra, len(tracked), sum(self._cpu.values()))

    async def _run(self) -> None:
        while True:  # every ``interval`` from the start of the last reading (not after it: readings take time)
            start = anyio.current_time()
            self._samples.append(await anyio.to_thread.run_sync(self._sample))
            await anyio.sleep(max(0.0, start + self.interval - anyio.current_time()))

    async def __aenter__(self) -> ResourceMonitor:
        self._t0 = time.monotonic()
        if self.subtree is not None:  # the CPU counter's value at the start (the parent may hold earlier runs')
            self._cpu0 = await anyio.to_thread.run_sync(self.subtree.cpu_seconds) or 0.0
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._tg is not None
        try:
            with anyio.CancelScope(shield=True):  # the last sample, also when the body was cancelled
                self._samples.append(await anyio.to_thread.run_sync(self._sample))
        finally:  # always leave the task group (a scope left entered breaks every scope around it)
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(exc_type, exc, tb)
            self._t1 = time.monotonic()

    def report(self) -> MemoryReport:
        samples = sorted(self._samples, key=lambda s: s.t)
        gib_s = 0.0
        for a, b in zip(samples, samples[1:], strict=False):
            gib_s += (a.pss_bytes + a.extra_bytes + b.pss_bytes + b.extra_bytes) / 2 * (b.t - a.t)
        end = (self._t1 or time.monotonic()) - self._t0
        return MemoryReport(
            interval=self.interval,
            duration=end,
            peak_bytes=max((s.pss_bytes + s.extra_bytes for s in samples), default=0),
            gib_seconds=gib_s / (1 << 30),
            cpu_seconds=max((s.cpu_seconds for s in samples), default=0.0),
            samples=samples,
        )
