"""An independent reading of what a run of the experiment holds and burns, beside the experiment's own accounting:
the PSS of every process in every cgroup under a cgroup parent, the page images they map beyond their PSS, the
snapshot store's file bytes and each workspace's own disk (its upper dir), every ``interval`` seconds; CPU from the
parent's own counter. Written from /proc, statvfs and the cgroup files directly, on purpose without the SDK's or
the experiment's accounting code (``_accounting``, ``ResourceMonitor``): it is what that code is checked against
(``test_experiment_accounting``, ``accounting_check``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from bunshin_async._config import Config
from bunshin_async._host._kernel import CGROUP_ROOT, cgroup_version

TOLERANCE = 0.05
"""Issue #32's acceptance: each figure within 5% of the independent reading."""


class Sampler:
    """Every ``interval`` seconds: the PSS of every process in every cgroup under ``cgroup_parent``, plus the page
    images they map beyond their PSS, plus the file bytes under ``store``; and the parent's CPU counter (default: the
    ``Config`` in force). Samples are labelled with the configuration running (``label``, set by the experiment's
    progress lines: ``configuration NAME`` or ``configuration NAME (repeat K of N)``)."""

    def __init__(self, interval: float = 0.1, cgroup_parent: str | None = None, store: Path | None = None) -> None:
        config = Config.current()
        parent = (cgroup_parent or config.cgroup_parent).strip("/")
        v2 = cgroup_version() == 2
        self.memory_root = CGROUP_ROOT / ("" if v2 else "memory") / parent
        self.cpu_file = CGROUP_ROOT / ("" if v2 else "cpuacct") / parent / ("cpu.stat" if v2 else "cpuacct.usage")
        self.store = store or config.snapshot_dir
        self.run_dir = config.run_dir  # workspace ws-<id>'s disk (its upper dir, a tmpfs) is <run_dir>/<id>
        self.interval = interval
        self.label = ""
        self.samples: list[tuple[str, float, int]] = []
        self.cpu_marks: list[tuple[str, float]] = []  # (label starting, counter then)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def cpu(self) -> float:
        try:
            text = self.cpu_file.read_text()
        except OSError:
            return 0.0
        if self.cpu_file.name == "cpu.stat":
            return next(int(line.split()[1]) / 1e6 for line in text.splitlines() if line.startswith("usage_usec"))
        return int(text) / 1e9

    def progress(self, line: str) -> None:
        if line.startswith("configuration "):
            self.mark(line.removeprefix("configuration "))

    def mark(self, label: str) -> None:
        self.cpu_marks.append((label, self.cpu()))
        self.label = label

    def memory(self) -> int:
        pids: set[int] = set()
        disks: dict[str, int] = {}  # workspace id -> bytes used on its own disk
        for d, _, _ in os.walk(self.memory_root):
            name = os.path.basename(d)
            if name.startswith("ws-"):  # what the workspace wrote: its own disk's used blocks (statvfs)
                disk = self.run_dir / name.removeprefix("ws-")
                try:
                    if os.stat(disk).st_dev != os.stat(self.run_dir).st_dev:  # mounted: a disk of its own
                        vfs = os.statvfs(disk)
                        disks[disk.name] = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
                except OSError:
                    pass
            try:
                pids.update(int(x) for x in Path(d, "cgroup.procs").read_text().split())
            except OSError:
                pass
        total = 0
        images: dict[tuple[int, int], list[int]] = {}  # inode -> [size, pss of its mappings]
        for pid in pids:
            try:
                lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
            except OSError:
                continue
            image: list[int] | None = None
            for line in lines:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 6 and ":" in head[3]:  # a mapping's first line
                    image = None
                    if "/pages-" in head[5] and ".img" in head[5]:
                        major, minor = (int(x, 16) for x in head[3].split(":"))
                        key = (os.makedev(major, minor), int(head[4]))
                        if key not in images:
                            lo, hi = (int(x, 16) for x in head[0].split("-"))
                            try:
                                size = os.stat(f"/proc/{pid}/map_files/{lo:x}-{hi:x}").st_size
                            except OSError:
                                size = 0
                            images[key] = [size, 0]
                        image = images[key]
                elif head and head[0] == "Pss:":
                    total += int(head[1]) * 1024
                    if image is not None:
                        image[1] += int(head[1]) * 1024
        total += sum(max(0, size - pss) for size, pss in images.values())
        total += sum(disks.values())
        for root, _, files in os.walk(self.store):
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in images:
                    total += st.st_blocks * 512
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            label, t0 = self.label, time.monotonic()
            memory = self.memory()
            self.samples.append((label, (t0 + time.monotonic()) / 2, memory))  # the reading's middle
            self._stop.wait(max(0.0, t0 + self.interval - time.monotonic()))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mark("")
        self._stop.set()
        self._thread.join()

    def figures(self, label: str) -> tuple[float, float, float]:
        """(GiB·s, peak MiB, CPU seconds) of configuration ``label``."""
        xs = [(t, b) for name, t, b in self.samples if name == label]
        gib_s = sum((b0 + b1) / 2 * (t1 - t0) for (t0, b0), (t1, b1) in zip(xs, xs[1:], strict=False)) / (1 << 30)
        marks = self.cpu_marks
        i = next(k for k, (name, _) in enumerate(marks) if name == label)
        return gib_s, max((b for _, b in xs), default=0) / (1 << 20), marks[i + 1][1] - marks[i][1]


class ConfigFigures(Protocol):
    """What ``compare`` reads of a ``bench.experiment`` ``ConfigResult``."""

    @property
    def name(self) -> str: ...
    @property
    def total_memory_gib_s(self) -> float: ...
    @property
    def peak_memory_mib(self) -> float: ...
    @property
    def cpu_seconds(self) -> float: ...


class Result(Protocol):
    """What ``compare`` reads of a ``bench.experiment`` ``ExperimentResult``: the first repeat and the later ones."""

    @property
    def configs(self) -> Sequence[ConfigFigures]: ...
    @property
    def later_repeats(self) -> Sequence[Sequence[ConfigFigures]]: ...


class Figure(NamedTuple):
    """One figure of one configuration (of one repeat), by the experiment and by the sampler."""

    label: str
    what: str  # "GiB·s", "peak MiB" or "CPU s"
    experiment: float
    independent: float

    @property
    def difference(self) -> float:
        """Relative to the independent reading (0 when both are 0)."""
        if self.independent:
            return (self.experiment - self.independent) / self.independent
        return 0.0 if not self.experiment else float("inf")


def compare(result: Result, sampler: Sampler) -> list[Figure]:
    """Every configuration of every repeat: GiB·s, peak and CPU by the experiment and by ``sampler``."""
    runs = [result.configs, *result.later_repeats]
    out = []
    for k, configs in enumerate(runs):
        for c in configs:
            label = c.name if len(runs) == 1 else f"{c.name} (repeat {k + 1} of {len(runs)})"
            gib_s, peak, cpu = sampler.figures(label)
            out += [
                Figure(label, "GiB·s", c.total_memory_gib_s, gib_s),
                Figure(label, "peak MiB", c.peak_memory_mib, peak),
                Figure(label, "CPU s", c.cpu_seconds, cpu),
            ]
    return out


def disagreements(figures: list[Figure], tolerance: float = TOLERANCE) -> list[str]:
    """The figures that differ by more than ``tolerance`` of the independent reading."""
    return [
        f"{f.label} {f.what}: experiment {f.experiment:.3f}, independent {f.independent:.3f}"
        for f in figures
        if abs(f.experiment - f.independent) > tolerance * f.independent
    ]


__all__ = ["TOLERANCE", "ConfigFigures", "Figure", "Result", "Sampler", "compare", "disagreements"]
