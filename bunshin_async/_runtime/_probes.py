"""Cost probes: what a fork and a main-line call cost, read from the workspace's cgroup and upper dir (blocking:
call from a worker thread, except ``cgroup_cpu_seconds``, a few bytes of sysfs)."""

from __future__ import annotations

from .._workspace._accounting import workspace_memory, written_bytes
from .._workspace._facade import Workspace

__all__ = [
    "call_peak", "cgroup_cpu_seconds", "fork_cost", "making_bytes", "memory_peak", "memory_usage", "upper_bytes",
]  # fmt: skip


def cgroup_cpu_seconds(ws: Workspace) -> float:
    """CPU time charged to the workspace's cgroup, or -1 without CPU accounting. Blocking."""
    cg = ws.cgroup
    seconds = cg.cpu_seconds() if cg is not None else None
    return -1.0 if seconds is None else seconds


def fork_cost(ws: Workspace, ready_peak: int | None = None) -> tuple[float, int]:
    """(CPU seconds, memory bytes) of a fork. Memory as the experiment's subtree reading counts it (its processes'
    PSS, the page images they map copy-on-write, its upper dir: ``workspace_memory``) plus what its call held only
    for a while: the cgroup's peak above both its peak when the call started (``ready_peak``: the restore's own
    charge, ~2 MiB, which the subtree reading of a running fork does not show) and its charge now. Without
    ``ready_peak``, the cgroup's peak plus the upper dir where that is more. Blocking."""
    cg = ws.cgroup
    held = workspace_memory(ws)
    peak = (cg.memory_peak() or 0) if cg is not None else 0
    if cg is None or ready_peak is None:
        return cgroup_cpu_seconds(ws), max(peak + upper_bytes(ws), held)
    return cgroup_cpu_seconds(ws), held + max(0, peak - max(ready_peak, cg.memory_usage() or 0))


def memory_peak(ws: Workspace) -> int | None:
    """The most bytes charged to ``ws``'s cgroup at once so far (None without a memory controller): a few bytes of
    sysfs, read in place."""
    cg = ws.cgroup
    return cg.memory_peak() if cg is not None else None


def memory_usage(ws: Workspace) -> int | None:
    """The bytes charged to ``ws``'s cgroup now (None without a memory controller): a few bytes of sysfs."""
    cg = ws.cgroup
    return cg.memory_usage() if cg is not None else None


def call_peak(ws: Workspace, ready_peak: int | None, ready_usage: int | None) -> int:
    """How far a call raised ``ws``'s cgroup above its charge when the call started (``ready_usage``): its peak
    less that charge, once the peak is past the one it had then (``ready_peak``, the restore's: CRIU and what it
    restored); a call that stayed under the restore's peak is measured 0 (at most that peak less the charge, ~1-2
    MiB). A few bytes of sysfs."""
    peak = memory_peak(ws) or 0
    if ready_peak is None or ready_usage is None or peak <= ready_peak:
        return 0
    return max(0, peak - ready_usage)


def making_bytes(ready_peak: int | None, ready_usage: int | None) -> int:
    """What making a fork held beyond the fork itself: its cgroup's peak when its call was about to start (CRIU's
    restore and what it restored) less its charge then (the fork's own processes, which the launch rule already
    charges as the fork's bytes for its whole hold, the making's seconds included). 0 where either is unknown."""
    if ready_peak is None or ready_usage is None:
        return 0
    return max(0, ready_peak - ready_usage)


def upper_bytes(ws: Workspace) -> int:
    """The bytes of ``ws``'s private upper dir (what it wrote): its own tmpfs's count (``written_bytes``), no walk of
    its tree but without a disk of its own (``Limits(disk=None)``). Blocking."""
    return written_bytes(ws.directory)
