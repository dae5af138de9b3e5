"""Memory and CPU accounting of a set of workspaces while a run is going.

Total memory is the summed PSS of every process of every tracked workspace (shared pages divided among their
sharers, so copy-on-write copies are not counted twice), plus what PSS cannot see: the page images that
copy-on-write copies map (resident in full on tmpfs, unlinked or not, however few pages were touched) and any other
snapshot bytes on tmpfs. It is sampled every ``interval`` seconds; the peak and the integral over time
(GiB-seconds: "total memory consumption") are reported.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
import msgspec

from . import _tree

if TYPE_CHECKING:
    from ._workspace import Workspace

__all__ = ["MemoryReport", "MemorySample", "ResourceMonitor", "pss_bytes", "tree_bytes"]


class MemorySample(msgspec.Struct, frozen=True, array_like=True):
    t: float  # seconds since the monitor started
    pss_bytes: int
    extra_bytes: int  # snapshots on tmpfs and copy-on-write page images, beyond what PSS shows
    workspaces: int


class MemoryReport(msgspec.Struct, frozen=True):
    interval: float
    duration: float
    peak_bytes: int
    gib_seconds: float
    cpu_seconds: float
    samples: list[MemorySample]


def pss_bytes(pids: Iterable[int]) -> int:
    """Summed proportional set size of ``pids`` (from /proc/PID/smaps_rollup). Blocking."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            pass
    return total


def mapped_image_bytes(pids: Iterable[int], marker: bytes = b"/pages-") -> tuple[int, set[tuple[int, int]]]:
    """Memory held by page-image files that ``pids`` map copy-on-write and that PSS does not show.

    A copy-on-write restore maps its CRIU page image (a tmpfs file, often already unlinked) MAP_PRIVATE: the whole
    file stays in RAM while any copy maps it, but PSS only counts the pages a process has touched. For each such
    file (by inode) this returns its size minus the PSS of every mapping of it (so no page is counted twice), and
    the inodes seen, so that a caller also walking the snapshot directory can skip them. Blocking."""
    sizes: dict[tuple[int, int], int] = {}
    pss: dict[tuple[int, int], int] = {}
    for pid in pids:
        try:
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
                                try:
                                    sizes[key] = os.stat(f"/proc/{pid}/map_files/{lo:x}-{hi:x}").st_size
                                except OSError:
                                    sizes[key] = 0
                    elif key is not None and line.startswith(b"Pss:"):
                        pss[key] = pss.get(key, 0) + int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
    return sum(max(0, sizes[k] - pss.get(k, 0)) for k in sizes), set(sizes)


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
    """Samples the memory of tracked workspaces in the background: ``async with ResourceMonitor() as mon:``,
    ``mon.track(ws)``; ``mon.report()`` afterwards. CPU seconds are those of processes alive at a sample (a
    lower bound for short-lived commands)."""

    def __init__(self, interval: float = 0.1, extra_dirs: Iterable[Path] = ()) -> None:
        self.interval = interval
        self.extra_dirs = list(extra_dirs)
        self._workspaces: set[Workspace] = set()
        self._samples: list[MemorySample] = []
        self._cpu: dict[int, float] = {}
        self._t0 = 0.0
        self._t1: float | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    def track(self, ws: Workspace) -> None:
        self._workspaces.add(ws)

    def untrack(self, ws: Workspace) -> None:
        self._workspaces.discard(ws)

    def _sample(self) -> MemorySample:
        pids = [pid for ws in list(self._workspaces) if ws.cgroup is not None for pid in ws.cgroup.pids()]
        for pid in pids:
            self._cpu[pid] = _cpu_seconds([pid])
        images, inodes = mapped_image_bytes(pids)
        extra = images + sum(tree_bytes(d, inodes) for d in self.extra_dirs if d.exists())
        return MemorySample(
            t=time.monotonic() - self._t0,
            pss_bytes=pss_bytes(pids),
            extra_bytes=extra,
            workspaces=len(self._workspaces),
        )

    async def _run(self) -> None:
        while True:
            self._samples.append(await anyio.to_thread.run_sync(self._sample))
            await anyio.sleep(self.interval)

    async def __aenter__(self) -> ResourceMonitor:
        self._t0 = time.monotonic()
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
            cpu_seconds=sum(self._cpu.values()),
            samples=samples,
        )
