"""What the launch rule weighs a fork's memory with, learned online: what a fork, its rollout and a committed
copy hold, and how long a rollout has still to run (a committed copy's lasting cost is weighed over it)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Ewma", "ForkMemory", "RolloutClock"]


class Ewma:
    __slots__ = ("value", "n")

    def __init__(self, value: float) -> None:
        self.value, self.n = value, 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.n == 0 else (1 - alpha) * self.value + alpha * x
        self.n += 1


class RolloutClock:
    """Each rollout's start (the first time the policy is asked about it) and the durations of those that ended.

    ``remaining(rollout)``: the mean duration of the ended rollouts less this one's elapsed time, at least a quarter
    of that mean (durations are heavy-tailed: a rollout past the mean tends to go on); before any ended, as long
    again as it has run, at least ``prior_seconds`` in all (the rollouts of a group start together, so the first to
    end comes late and the time a rollout has run is the only hint of its length). A rollout never seen counts
    ``prior_seconds``. Bounded: only running rollouts are kept."""

    def __init__(self, prior_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.prior_seconds = prior_seconds
        self.clock = clock
        self._start: dict[str, float] = {}
        self._sum, self._n = 0.0, 0

    def seen(self, rollout: str) -> None:
        if rollout and rollout not in self._start:
            self._start[rollout] = self.clock()

    def done(self, rollout: str) -> None:
        start = self._start.pop(rollout, None)
        if start is not None:
            self._sum += self.clock() - start
            self._n += 1

    def remaining(self, rollout: str) -> float:
        start = self._start.get(rollout)
        if start is None:
            return self.prior_seconds
        elapsed = self.clock() - start
        if self._n:
            mean = self._sum / self._n
            return max(mean - elapsed, 0.25 * mean)
        return max(self.prior_seconds - elapsed, elapsed)


class ForkMemory:
    """Bytes as the experiment counts them (PSS, mapped page images, upper dirs, a fork's layer), running averages
    (``alpha``): ``fork_bytes`` what a fork holds beside its rollout (until measured: ``prior_bytes``),
    ``rollout_bytes`` what a rollout holds (until measured: as much), ``copy_extra`` what a fork holds more than its
    rollout, measured in pairs (``observe_copy``), ``miss_bytes`` what a discarded fork held at its end, its call's
    memory included (``observe_miss``; until measured: as much as a fork), and ``rollouts``, how long each rollout
    has to go."""

    def __init__(self, prior_bytes: float, alpha: float, rollout_seconds: float, clock: Callable[[], float]) -> None:
        self.alpha = alpha
        self.fork_bytes = Ewma(prior_bytes)
        self.rollout_bytes = Ewma(prior_bytes)
        self.copy_extra = Ewma(0.0)
        self.miss_bytes: Ewma | None = None
        self.rollouts = RolloutClock(rollout_seconds, clock)

    def observe_fork(self, memory_bytes: int) -> None:
        if memory_bytes > 0:
            self.fork_bytes.add(float(memory_bytes), self.alpha)

    def observe_rollout(self, memory_bytes: int) -> None:
        if memory_bytes > 0:
            self.rollout_bytes.add(float(memory_bytes), self.alpha)

    def observe_miss(self, memory_bytes: int) -> None:
        if memory_bytes > 0:
            if self.miss_bytes is None:
                self.miss_bytes = Ewma(float(memory_bytes))
            self.miss_bytes.add(float(memory_bytes), self.alpha)

    def held(self, probability: float) -> float:
        """The bytes a fork is expected to hold beside its rollout until the ask: its own (``fork_bytes``, measured
        before its call), and, for a miss, what its call held (``miss_bytes`` beyond that): a hit's call holds the
        same on the main line, only earlier, so it is no cost of the fork."""
        miss = self.miss_bytes.value if self.miss_bytes is not None else 0.0
        return self.fork_bytes.value + (1 - probability) * max(0.0, miss - self.fork_bytes.value)

    def observe_copy(self, copy_bytes: int, rollout_bytes: int) -> None:
        """Beside a fork, before its call: what the fork holds (its processes, its layer) and what its rollout
        holds. A hit's copy replaces the rollout (whose upper dir then goes: the layer is its copy), so the
        difference is what a hit leaves the rollout for the rest of its life."""
        if copy_bytes > 0 and rollout_bytes > 0:
            self.copy_extra.add(float(copy_bytes - rollout_bytes), self.alpha)

    def lasting(self, rollout: str) -> float:
        """Byte-seconds a hit's copy adds to ``rollout`` until it ends: what a copy holds more than its rollout (at
        least 0: a fork is never launched to save memory) x the rollout's expected remaining time. Hits that follow
        one another are each charged to the rollout's end: an upper bound (a copy's own snapshots are incremental on
        the images it maps, so a chain of such copies holds each one's)."""
        return max(0.0, self.copy_extra.value) * self.rollouts.remaining(rollout)
