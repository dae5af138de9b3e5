"""The experiment's accounting against an independent sampler: every configuration's GiB·s, peak memory and CPU agree
within 5% with a sampler written here, which reads /proc and the cgroup files directly over the whole cgroup parent
and snapshot store of this test run (so it sees whatever the configuration made, tracked by anyone or not).

The workload makes the cases the old per-workspace accounting missed: a slow write that speculation commits (the
rollout moves into the branch's fork) or the cache serves by restoring a fork, after which the rollout allocates
memory and burns CPU in a short-lived process."""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

import pytest

import speculator
from bench.experiment._runner import ExperimentResult, run_experiment
from bunshin_async._config import Config
from bunshin_async._host._kernel import CGROUP_ROOT, cgroup_version
from bunshin_async.rollout import Step, Task, Trajectory

pytestmark = [pytest.mark.root, pytest.mark.slow]

HOLD_MIB = 96
# Allocates and touches HOLD_MIB MiB, burns a fixed amount of CPU (not a wall-clock time: the machine is shared),
# then holds the memory a while and exits: its CPU is only in the cgroup's counter once it is gone. Two samplers
# disagree where memory changes between their samples: the hold is long against a sample's spacing on a busy machine.
ALLOCATE = (
    f'python3 -c \'x = bytearray({HOLD_MIB} << 20); x[::4096] = b"\\1" * len(x[::4096]); '
    "sum(range(15_000_000)); import time; time.sleep(8)'"  # an argument follows (ignored)
)
SLOW_WRITE = "sleep 1.2; echo x > f"


class Sampler:
    """Every ``interval`` seconds: the PSS of every process in every cgroup under the run's cgroup parent, plus the
    page images they map beyond their PSS, plus the snapshot store's file bytes; and the parent's CPU counter.
    Samples are labelled with the configuration running (``label``, set by the experiment's progress lines)."""

    def __init__(self, interval: float = 0.1) -> None:
        config = Config.current()
        v2 = cgroup_version() == 2
        self.memory_root = CGROUP_ROOT / ("" if v2 else "memory") / config.cgroup_parent
        self.cpu_file = (
            CGROUP_ROOT / ("" if v2 else "cpuacct") / config.cgroup_parent / ("cpu.stat" if v2 else "cpuacct.usage")
        )
        self.store = config.snapshot_dir
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
            self.mark(line.split()[1])

    def mark(self, label: str) -> None:
        self.cpu_marks.append((label, self.cpu()))
        self.label = label

    def memory(self) -> int:
        pids: set[int] = set()
        for d, _, _ in os.walk(self.memory_root):
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
        return gib_s, max(b for _, b in xs) / (1 << 20), marks[i + 1][1] - marks[i][1]


def _agree(result: ExperimentResult, sampler: Sampler) -> list[str]:
    out = []
    for c in result.configs:
        gib_s, peak, cpu = sampler.figures(c.name)
        for what, ours, theirs in (
            ("GiB·s", c.total_memory_gib_s, gib_s),
            ("peak MiB", c.peak_memory_mib, peak),
            ("CPU s", c.cpu_seconds, cpu),
        ):
            if abs(ours - theirs) > 0.05 * theirs:
                out.append(f"{c.name} {what}: experiment {ours:.3f}, independent {theirs:.3f}")
    return out


def _step(command: str, llm: float) -> Step:
    return Step("bash", {"command": command}, llm_seconds=llm, tool_seconds=1.0)


@pytest.mark.timeout(900)
async def test_a_committed_write_then_memory_and_cpu_are_counted_in_every_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rollout: a slow write (committed from a speculative fork in the oracle, served by a restored fork
    from the cache's capture in a sibling), then a process that allocates HOLD_MIB MiB and burns CPU in the
    rollout's workspace, whichever fork that is now. Every configuration counts it: at least the rollouts' memory
    at its peak, and GiB·s, peak and CPU within 5% of the independent sampler."""
    task = Task(task_id="acct", prompt="allocate")
    done = Step(None, None, llm_seconds=0.05, assistant_text="done")
    trajs = [
        Trajectory(task_id="acct", rollout=i, steps=[_step(SLOW_WRITE, 0.05), _step(f"{ALLOCATE} {i}", 1.5), done])
        for i in range(2)  # the siblings' allocations differ: each runs its own, at the same time
    ]
    # What is counted once a branch commits is the point here: the policy's GiB·s rule (a fork pays only when its
    # hidden seconds outweigh what it holds) would launch nothing on these few-MiB workspaces, so it is off.
    monkeypatch.setattr(speculator, "CostAwarePolicy", functools.partial(speculator.CostAwarePolicy, memory_weight=0.0))
    with Sampler() as sampler:
        result = await run_experiment([(task, trajs)], progress=sampler.progress)
    assert result.same_calls_and_results, result.differences
    disagree = _agree(result, sampler)
    by_name = {c.name: c for c in result.configs}
    assert by_name["oracle"].extra["spec"]["committed"] >= 2  # the write, then the allocation, in forks
    for c in result.configs:
        assert [r.status for r in c.rollouts] == ["finished", "finished"], c.name
        assert c.peak_memory_mib >= 2 * HOLD_MIB, (c.name, c.peak_memory_mib)
    assert not disagree, disagree
