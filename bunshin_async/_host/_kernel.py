"""The kernel interface: cgroups (v1 and v2) and facts about the host.

This host mounts cgroup v1 controllers with an empty v2 hierarchy beside them; most users' hosts are pure v2.
``Cgroups.create`` hides the difference: callers get the ``cgroup.procs`` files to join and one ``destroy()``.
"""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path
from typing import Literal

import anyio
import msgspec

from .._config import Config
from .._exceptions import CapabilityMissing, InvalidValue
from .._fallback import fallback

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer", "devices")
"""Joined where mounted; ``cpuacct`` gives each workspace its CPU time (mounted apart from ``cpu`` on some hosts,
with it, ``cpu,cpuacct``, on others: a controller mounted with one already joined is skipped)."""


def parent_name() -> str:
    """The cgroup directory all workspaces live under (``Config.cgroup_parent``, ``BUNSHIN_CGROUP_PARENT``: moved
    e.g. per test run)."""
    return Config.current().cgroup_parent


DEFAULT_DISK = 1 << 30
"""``Limits.disk`` by default: a quarter of the default memory limit, which its tmpfs pages count in."""


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Resource limits of one workspace. ``memory`` in bytes, ``cpus`` in cores (1.5 = one and a half), None for
    no limit. The memory limit kills the workspace's biggest process, never the host or a sibling."""

    memory: int | None = 4 << 30
    pids: int | None = 4096
    cpus: float | None = None
    disk: int | None = DEFAULT_DISK
    """Bytes the workspace may add to its image (its overlay upper layer): 1 GiB unless raised. The upper and work
    dirs live on a tmpfs of that size, so a full disk fails inside with ENOSPC and nothing reaches the host's disk
    (this host's kernel has no filesystem project quotas: ``bunshin doctor``). Its pages count in ``memory``: keep
    ``disk`` below it (past the memory limit the writer is OOM-killed instead of getting ENOSPC). None lifts the
    bound: the upper layer on the host's filesystem, unbounded (logged: the workspace can fill the host's disk)."""
    nofile: int | None = 1 << 16
    """RLIMIT_NOFILE (soft and hard) of every process in the workspace (at most the host's hard limit where the host
    cannot raise it: no CAP_SYS_RESOURCE); None keeps the host's."""

    def __post_init__(self) -> None:
        if self.memory is not None and self.memory < (16 << 20):
            raise InvalidValue("memory limit must be at least 16 MiB", argument="memory")
        if self.pids is not None and self.pids < 8:
            raise InvalidValue("pids limit must be at least 8", argument="pids")
        if self.cpus is not None and self.cpus <= 0:
            raise InvalidValue("cpus must be positive", argument="cpus")
        if self.disk is not None and self.disk < (1 << 20):
            raise InvalidValue("disk limit must be at least 1 MiB", argument="disk")
        if self.nofile is not None and not 64 <= self.nofile <= 1 << 20:
            raise InvalidValue("nofile must be between 64 and 1048576", argument="nofile")


def cgroup_version() -> int | None:
    """2 on a pure (unified) cgroup v2 host, 1 where v1 controllers are mounted, None without cgroups."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return 2
    if (CGROUP_ROOT / "memory" / "cgroup.procs").exists():
        return 1
    return None


def devices_controller() -> bool:
    """Whether device allow-lists can be enforced: the cgroup v1 devices controller (cgroup v2 has no file
    interface for it, only BPF programs, which Bunshin does not load)."""
    return (CGROUP_ROOT / "devices" / "devices.allow").exists()


_LIMITED_BY = {"memory": "memory", "pids": "pids", "cpu": "cpus"}
"""The controller each ``Limits`` field needs."""


def _require_controllers(limits: Limits, available: set[str]) -> None:
    """A limit whose controller the host lacks is not silently dropped: ``fallback`` raises (or, with the
    controller in ``Config.allow_missing``, warns once and the limit goes unenforced)."""
    for ctrl, field in _LIMITED_BY.items():
        if getattr(limits, field) is not None and ctrl not in available:
            fallback(
                f"cgroup {ctrl}",
                missing=f"Limits({field}=...) needs the cgroup {ctrl} controller, which this host does not offer",
                lost=f"the {field} limit (not enforced)",
                remedy=f"enable the {ctrl} controller (cgroup v2: listed in {CGROUP_ROOT}/cgroup.controllers), "
                f"or pass Limits({field}=None)",
            )


def _hierarchy(d: Path) -> str:
    """The v1 hierarchy (``memory``, ``freezer``, ...) a cgroup directory is in, at whatever depth."""
    try:
        return d.relative_to(CGROUP_ROOT).parts[0]
    except (ValueError, IndexError):
        return ""


def _enable_controllers(parent: str) -> None:
    """cgroup v2: enable memory, pids and cpu for the children of the root and of every cgroup down to ``parent``
    (a controller reaches a cgroup only if each of its ancestors enables it for its children)."""
    wanted = {"memory", "pids", "cpu"} & set((CGROUP_ROOT / "cgroup.controllers").read_text().split())
    chain = [CGROUP_ROOT, *(CGROUP_ROOT / p for p in reversed(Path(parent).parents) if p.parts), CGROUP_ROOT / parent]
    for d in chain:
        missing = wanted - set((d / "cgroup.subtree_control").read_text().split())
        if missing:
            _write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(missing)))


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Cgroup:
    """One workspace's cgroup (one directory per v1 controller, or one v2 directory)."""

    def __init__(self, version: int, dirs: list[Path]) -> None:
        self.version = version
        self.dirs = dirs
        self._cpu_file: Path | Literal[False] | None = None  # where its CPU time is read; False: nowhere

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    @property
    def memory_dir(self) -> Path | None:
        if self.version == 2:
            return self.dirs[0]
        return next((d for d in self.dirs if _hierarchy(d) == "memory"), None)

    @property
    def freezer_dir(self) -> Path | None:
        if self.version == 2:
            return self.dirs[0]
        return next((d for d in self.dirs if _hierarchy(d) == "freezer"), None)

    def _freezer(self) -> tuple[Path, str, str] | None:
        """(control file, frozen value, thawed value) of the freezer: v1 ``freezer.state``, v2 ``cgroup.freeze``."""
        d = self.freezer_dir
        if d is None:
            return None
        return (d / "freezer.state", "FROZEN", "THAWED") if self.version == 1 else (d / "cgroup.freeze", "1", "0")

    def frozen(self) -> bool:
        """Whether every task of the cgroup is frozen (v2 reports it in ``cgroup.events``; blocking)."""
        d = self.freezer_dir
        if d is None:
            return False
        if self.version == 1:
            return (d / "freezer.state").read_text().strip() == "FROZEN"
        return "frozen 1" in (d / "cgroup.events").read_text().splitlines()

    async def freeze(self, timeout: float = 10.0) -> None:
        """Freeze every task of the cgroup and wait until they are (``TimeoutError`` past ``timeout`` seconds: a
        task in uninterruptible sleep may not freeze). Raises ``OSError`` without a freezer."""
        ctl = self._freezer()
        if ctl is None:
            raise FileNotFoundError(f"cgroup {self.dirs[0] if self.dirs else '?'} has no freezer")
        _write(ctl[0], ctl[1])
        delay = 0.0005
        with anyio.fail_after(timeout):
            while not self.frozen():
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.02)

    def thaw(self) -> None:
        """Thaw the cgroup (best effort, idempotent). A CRIU or a process killed while the tree is frozen leaves it
        frozen, and a frozen v1 task does not even die of SIGKILL until thawed."""
        ctl = self._freezer()
        if ctl is not None:
            try:
                _write(ctl[0], ctl[2])
            except OSError:
                pass

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:  # removed meanwhile (ENOENT, or ENODEV while the read races the removal): no processes
                pass
        return sorted(out)

    def cpu_seconds(self) -> float | None:
        """CPU time charged to the cgroup (v1 ``cpuacct.usage``, v2 ``cpu.stat``'s ``usage_usec``), None without CPU
        accounting or once removed. Blocking: one read of a small file (which one is found once)."""
        path = self._cpu_file
        if path is None:
            name = "cpu.stat" if self.version == 2 else "cpuacct.usage"
            found: Path | Literal[False] = next((d / name for d in self.dirs if (d / name).exists()), False)
            path = self._cpu_file = found
        if path is False:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # not read_text: this runs twice per tool call
            try:
                text = os.read(fd, 4096).decode()
            finally:
                os.close(fd)
            if self.version == 1:
                return int(text) / 1e9
            return next(int(line.split()[1]) / 1e6 for line in text.splitlines() if line.startswith("usage_usec "))
        except (OSError, ValueError, IndexError, StopIteration):  # removed meanwhile (ENOENT, ENODEV)
            return None

    def memory_usage(self) -> int | None:
        """Bytes charged to the cgroup now (v1 ``memory.usage_in_bytes``, v2 ``memory.current``: its pages and page
        cache, not the tmpfs page images a copy maps), None without a memory controller or once removed."""
        d = self.memory_dir
        if d is None:
            return None
        try:
            return int((d / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")).read_text())
        except (OSError, ValueError):  # removed meanwhile (ENOENT, ENODEV)
            return None

    def memory_peak(self) -> int | None:
        d = self.memory_dir
        if d is None:
            return None
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((d / name).read_text())
        except (OSError, ValueError):  # removed meanwhile (ENOENT, ENODEV)
            return None

    @classmethod
    def create(cls, name: str, limits: Limits, devices: list[str] | None = None) -> Cgroup:
        """``devices``: the devices allow-list (``devices.allow`` rules, everything else denied), None for none;
        enforced where ``devices_controller()`` (the caller drops MKNOD elsewhere)."""
        version = cgroup_version()
        if version is None:
            raise CapabilityMissing(
                "no cgroup hierarchy under /sys/fs/cgroup",
                capability="cgroups",
                remedy="mount cgroup2 on /sys/fs/cgroup or run on a host with cgroups",
            )
        try:
            return cls._create_v2(name, limits) if version == 2 else cls._create_v1(name, limits, devices)
        except PermissionError as exc:
            raise CapabilityMissing(
                f"cannot create a cgroup: {exc}", capability="cgroups", remedy="run as root"
            ) from exc

    @classmethod
    def make_parent(cls, parent: str) -> Cgroup:
        """The parent cgroup ``parent`` (e.g. ``bunshin/run-1``) in every hierarchy a workspace joins, made if
        missing, with the v2 controllers enabled down to it: a run's subtree exists, with its counters at zero,
        before its first workspace. The caller removes it (``_rmdir_all`` once its children are gone)."""
        version = cgroup_version()
        if version == 2:
            d = CGROUP_ROOT / parent
            d.mkdir(parents=True, exist_ok=True)
            _enable_controllers(parent)
            return cls(2, [d])
        dirs, seen = [], set()
        for ctrl in V1_CONTROLLERS:
            base = CGROUP_ROOT / ctrl
            if (base / "cgroup.procs").exists() and (real := base.resolve()) not in seen:
                seen.add(real)
                (base / parent).mkdir(parents=True, exist_ok=True)
                dirs.append(base / parent)
        return cls(1, dirs)

    @classmethod
    def make_cpu_account(cls, name: str) -> Cgroup | None:
        """A fresh cgroup ``name`` under the workspaces' parent that only accounts CPU (v1: in the ``cpuacct``
        hierarchy alone; v2: a leaf, which no limit applies to) for a host helper working for the run (CRIU's
        dump): the parent's counter then includes it. None without CPU accounting. Named ``<what>-<pid>-<n>``,
        one left by a killed process is collected with the run scopes (``bunshin gc``). Blocking."""
        version = cgroup_version()
        if version == 2:
            parent = CGROUP_ROOT / parent_name()
            parent.mkdir(parents=True, exist_ok=True)
            _enable_controllers(parent_name())
        elif version == 1 and (CGROUP_ROOT / "cpuacct" / "cgroup.procs").exists():
            parent = CGROUP_ROOT / "cpuacct" / parent_name()
            parent.mkdir(parents=True, exist_ok=True)
        else:
            return None
        (parent / name).mkdir()
        return cls(version, [parent / name])

    @classmethod
    def _create_v1(cls, name: str, limits: Limits, devices: list[str] | None) -> Cgroup:
        _require_controllers(limits, {c for c in V1_CONTROLLERS if (CGROUP_ROOT / c / "cgroup.procs").exists()})
        dirs: list[Path] = []
        group = cls(1, dirs)
        try:
            seen: set[Path] = set()
            for ctrl in V1_CONTROLLERS:
                base = CGROUP_ROOT / ctrl
                if not (base / "cgroup.procs").exists() or (real := base.resolve()) in seen:
                    continue
                seen.add(real)
                (base / parent_name()).mkdir(parents=True, exist_ok=True)  # nested: a run's own parent
                d = base / parent_name() / name
                d.mkdir()
                dirs.append(d)
                if ctrl == "memory" and limits.memory is not None:
                    _write(d / "memory.limit_in_bytes", str(limits.memory))
                elif ctrl == "pids" and limits.pids is not None:
                    _write(d / "pids.max", str(limits.pids))
                elif ctrl == "cpu" and limits.cpus is not None:
                    _write(d / "cpu.cfs_period_us", "100000")
                    _write(d / "cpu.cfs_quota_us", str(int(limits.cpus * 100000)))
                elif ctrl == "devices" and devices is not None:
                    _write(d / "devices.deny", "a")
                    for rule in devices:
                        _write(d / "devices.allow", rule)
        except BaseException:
            group.destroy_sync()
            raise
        return group

    @classmethod
    def _create_v2(cls, name: str, limits: Limits) -> Cgroup:
        parent = CGROUP_ROOT / parent_name()
        parent.mkdir(parents=True, exist_ok=True)
        available = set((CGROUP_ROOT / "cgroup.controllers").read_text().split())
        _require_controllers(limits, available)
        _enable_controllers(parent_name())
        d = parent / name
        d.mkdir()
        group = cls(2, [d])
        try:
            if limits.memory is not None:
                _write(d / "memory.max", str(limits.memory))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
            if limits.pids is not None:
                _write(d / "pids.max", str(limits.pids))
            if limits.cpus is not None:
                _write(d / "cpu.max", f"{int(limits.cpus * 100000)} 100000")
        except BaseException:
            group.destroy_sync()
            raise
        return group

    def kill_all(self) -> None:
        if self.version == 2 and (self.dirs[0] / "cgroup.kill").exists():
            try:
                _write(self.dirs[0] / "cgroup.kill", "1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _rmdir_all(self) -> bool:
        left = []
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # EBUSY while the last processes exit
                left.append(d)
        self.dirs = left
        return not left

    def destroy_sync(self) -> None:
        """Kill what is left and remove the directories (blocking; for error paths before any await)."""
        self.kill_all()
        for _ in range(2000):
            if self._rmdir_all():
                return
            os.sched_yield()

    async def destroy(self, timeout: float = 10.0) -> None:
        """Kill every process left in the cgroup and remove its directories."""
        with anyio.move_on_after(timeout):
            delay = 0.0005
            while True:
                self.kill_all()
                if self._rmdir_all():
                    return
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.05)


class CgroupView:
    """What ``Workspace.cgroup`` shows of a workspace's cgroup: its directories and counters, read-only. Freezing,
    killing and removing it stay with the workspace (a frozen workspace's tools would hang; a removed cgroup would
    leave its processes unlimited). Views of one cgroup compare equal."""

    __slots__ = ("_cg",)

    def __init__(self, cgroup: Cgroup) -> None:
        self._cg = cgroup

    @property
    def dirs(self) -> tuple[Path, ...]:
        """One directory per v1 controller, or the one v2 directory."""
        return tuple(self._cg.dirs)

    def pids(self) -> list[int]:
        """The host pids of every process in the cgroup (blocking)."""
        return self._cg.pids()

    def frozen(self) -> bool:
        """Whether every task is frozen (a warm spare is; blocking)."""
        return self._cg.frozen()

    def cpu_seconds(self) -> float | None:
        """CPU time charged to the cgroup, None without CPU accounting (blocking)."""
        return self._cg.cpu_seconds()

    def memory_usage(self) -> int | None:
        """Bytes charged to the cgroup now, None without a memory controller (blocking)."""
        return self._cg.memory_usage()

    def memory_peak(self) -> int | None:
        """The most bytes charged to the cgroup at once, None without a memory controller (blocking)."""
        return self._cg.memory_peak()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CgroupView) and other._cg is self._cg

    def __hash__(self) -> int:
        return id(self._cg)

    def __repr__(self) -> str:
        return f"<CgroupView {', '.join(map(str, self._cg.dirs))}>"


def task_status(pid: int) -> dict[str, str] | None:
    """The fields of ``/proc/<pid>/status`` (proc(5): ``PPid``, ``State``, ``TracerPid``, ``NSpid``, the task's pid
    in each pid namespace it is in, innermost last), stripped; None once it is gone (blocking)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def owner_token(pid: int) -> str:
    """``pid`` and its start time: names an owner (of a workspace dir, a layer) so that a recycled pid is not
    mistaken for it (``alive``)."""
    return f"{pid} {_start_time(pid)}"


def read_token(path: Path) -> str | None:
    """The owner token in the file ``path`` (``owner_token``), None if there is none: no such file, not a regular
    file (a symlink is not followed), or empty (still being written). At most 64 bytes are read (blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 64).decode(errors="replace").strip() or None
    except OSError:
        return None
    finally:
        os.close(fd)


def alive(token: str) -> bool:
    try:
        pid_s, start = token.split()
        return _start_time(int(pid_s)) == start
    except ValueError:
        return False


def prime_cgroup_attach() -> None:
    """Start the grace period that the next cgroup attach would wait for (blocking, best effort; call it in a
    thread while other work goes on). Any migration takes ``cgroup_threadgroup_rwsem`` for writing, and the first
    writer after an idle spell waits a full RCU grace period in ``rcu_sync_enter`` (~8 ms here); writers that come
    during that period or within one period after the last writer leaves pass at once. Moving this process into the
    cgroup it is already in is such a writer and changes nothing."""
    me = str(os.getpid())
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _hid, controllers, path = line.split(":", 2)
        if controllers.startswith("name="):
            continue
        base = CGROUP_ROOT if not controllers else CGROUP_ROOT / controllers.split(",")[0]
        try:
            (base / path.lstrip("/") / "cgroup.procs").write_text(me)
            return
        except OSError:
            continue


def mount_options(path: Path) -> tuple[str, str] | None:
    """The filesystem type and super-block options of the mount ``path`` is on (the deepest mount point that is a
    prefix of its resolved path, per /proc/self/mountinfo), or None if none is found."""
    target = os.path.realpath(path)
    best: tuple[int, str, str] | None = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        point = fields[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        if target == point or target.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= best[0]:
                best = (len(point), fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else "")
    return None if best is None else (best[1], best[2])


def mount_disk(path: Path, size: int) -> None:
    """A tmpfs of ``size`` bytes (and as many inodes as 1 KiB files would fill) on the empty directory ``path``: a
    workspace's size-limited disk (``Limits.disk``; blocking). Raises ``CapabilityMissing`` when it cannot mount."""
    from .. import _native

    opts = f"size={size},nr_inodes={max(size // 1024, 1024)},mode=0700"
    try:
        _native.mount("bunshin-disk", str(path), "tmpfs", 0x2 | 0x4, opts)  # MS_NOSUID | MS_NODEV
    except OSError as exc:
        raise CapabilityMissing(
            f"cannot mount a tmpfs on {path}: {exc.strerror}", capability="disk limit", remedy="run as root"
        ) from exc


def mounts_at(path: Path, *, below_only: bool = False) -> list[str]:
    """The mount points in this mount namespace at ``path`` (unless ``below_only``) or below it, deepest first
    (proc(5) mountinfo: the 5th field, with octal escapes). Blocking."""
    base = str(path.resolve())
    found = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(base + "/") or (point == base and not below_only):
                found.add(point)
    return sorted(found, key=lambda p: -p.count("/"))


def detach_mounts(path: Path) -> list[str]:
    """Detach every mount at or below ``path`` (a dead workspace's disk, a run scope's store), deepest first;
    a line per mount (blocking)."""
    from .. import _native

    out = []
    for point in mounts_at(path):
        try:
            _native.umount2(point, 2)  # MNT_DETACH
            out.append(f"unmounted {point}")
        except OSError as exc:
            out.append(f"could not unmount {point}: {os.strerror(exc.errno or 0)}")
    return out


def unmount_disk(path: Path) -> None:
    """Detach ``mount_disk``'s tmpfs from ``path`` if it is there (blocking; idempotent)."""
    from .. import _native

    if os.path.ismount(path):
        try:
            _native.umount2(str(path), 2)  # MNT_DETACH
        except OSError:
            pass
