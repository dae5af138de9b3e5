"""Cost probes: what a fork and a main-line call cost, read from the workspace's cgroup and upper dir (blocking:
call from a worker thread, except ``cgroup_cpu_seconds``, a few bytes of sysfs)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from .._workspace._accounting import workspace_memory, written_bytes
from .._workspace._facade import Workspace

__all__ = [
    "CallMeter", "call_peak", "cgroup_cpu_seconds", "fork_cost", "held_charge", "making_bytes", "memory_peak",
    "memory_usage", "upper_bytes",
]  # fmt: skip

T = TypeVar("T")


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


def held_charge(ws: Workspace) -> int | None:
    """What ``ws``'s processes and writes hold now by its cgroup's ``memory.stat``, its children's included:
    anonymous and shmem (tmpfs) pages (v1 ``total_rss`` + ``total_shmem``, v2 ``anon`` + ``shmem``;
    cgroup-v1/memory.rst, cgroup-v2.rst), as the experiment counts memory (PSS, upper dirs), not the page cache of
    files they only read, which ``memory_usage`` counts (a ``pip install`` left ~9 MiB of it charged after it exited).
    None without a memory controller or once removed. A few hundred bytes of sysfs, read in place (only the memory
    controller's directory, v1, or the one v2 directory, has the file)."""
    cg = ws.cgroup
    for d in cg.dirs if cg is not None else ():
        try:
            text = (d / "memory.stat").read_bytes()
        except OSError:  # not the memory controller's directory, or removed meanwhile
            continue
        stat = dict(line.split(b" ", 1) for line in text.splitlines() if b" " in line)
        fields = (b"total_rss", b"total_shmem") if b"total_rss" in stat else (b"anon", b"shmem")
        return sum(int(stat.get(f, b"0")) for f in fields)
    return None


class CallMeter:
    """Byte-seconds a call holds in its workspace: what the cgroup holds (``held_charge``: its processes' anonymous
    pages, what they wrote to tmpfs) above what it held when the call started, read every ``interval`` seconds
    while the call runs and integrated by trapezoids, as the experiment's sampler integrates a run's memory. A
    call's peak (``call_peak``) says how high it went, not for how long: a padded ``pip install``
    (``bench.experiment --pad-tools``) holds its ~40 MiB for a second and sleeps for the rest of its recorded 15 s.
    ``byte_seconds`` is -1 without a memory controller."""

    def __init__(self, ws: Workspace, clock: Callable[[], float], interval: float = 0.1) -> None:
        self.ws, self.clock, self.interval = ws, clock, interval
        self.byte_seconds = -1.0
        self._base: int | None = None
        self._last: tuple[float, int] | None = None
        self._stopped = False

    def sample(self) -> None:
        """Read the charge now and add the stretch since the last reading (the first reading is the base).
        Blocking: ``memory.stat`` took 0.1-0.2 ms here (v1, loaded); the meter's own readings go through a worker
        thread (``_sample``)."""
        if not self._stopped:
            self._add(held_charge(self.ws))

    async def _sample(self) -> None:
        """``sample`` with the read in a worker thread: every ``interval`` for every call a fork runs, on the event
        loop it took the loop's time."""
        if not self._stopped:
            self._add(await anyio.to_thread.run_sync(held_charge, self.ws))

    def _add(self, held: int | None) -> None:
        if self._stopped or held is None:
            return
        now = self.clock()
        if self._base is None:
            self._base, self.byte_seconds = held, 0.0
        above = max(0, held - self._base)
        if self._last is not None:
            then, before = self._last
            self.byte_seconds += max(0.0, now - then) * (before + above) / 2
        self._last = (now, above)

    def stop(self) -> float:
        """The call ended (or was cut short): a last reading, then no more; ``byte_seconds``. Idempotent."""
        self.sample()
        self._stopped = True
        return self.byte_seconds

    async def during(self, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()`` while sampling (the first reading before it starts); stopped when it returns, raises or
        is cancelled (its error is raised as itself, not wrapped in a group). A callable, not an awaitable: the first
        reading is an await (a worker thread), and a branch cancelled there left a coroutine never awaited."""
        await self._sample()
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._every)
            try:
                out = await call()
            except Exception as exc:  # noqa: BLE001 - re-raised below, once the sampler has stopped
                error = exc
            finally:
                with anyio.CancelScope(shield=True):
                    await self._sample()  # the last reading
                self._stopped = True
                tg.cancel_scope.cancel()
        if error is not None:
            raise error
        return out

    async def _every(self) -> None:
        while not self._stopped:
            await anyio.sleep(self.interval)
            await self._sample()
