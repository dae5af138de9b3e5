"""What the launch rule weighs a fork's memory with, learned online: what a fork, its rollout and a committed
copy hold, and how long a rollout has still to run (a committed copy's lasting cost is weighed over it)."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from bunshin_async.rollout import byte_seconds_net

__all__ = ["Ewma", "ForkMemory", "MemoryTerms", "RolloutClock"]


class MemoryTerms(msgspec.Struct, frozen=True):
    """The launch rule's terms for one fork, byte-seconds unless said: ``freed``, what a hit is expected to free (p x
    the seconds it hides x the rollout's bytes x its straggler factor: the rollout ends that much sooner);
    ``held`` bytes the fork holds beside its rollout for ``hold`` seconds, hit or miss; ``miss``, what a miss's call
    is expected to hold ((1 - p) x its byte-seconds in the seconds it runs before the ask: a hit's call holds the
    same on the main line, only earlier); ``lasting``, what a hit's copy is expected to add to the rollout until it
    ends (p x ``ForkMemory.lasting``; negative: it saves); ``transient``, what making the fork holds while it is
    made (CRIU's processes, the restore's charge: ``ForkMemory.transient_bytes`` x the fork's seconds), hit or miss;
    ``call``, what a hit's call is expected to hold in the fork beyond what it would hold on the main line (p x
    ``CallMemory.extra``: a call run in a fork beside others' forks ran longer, and one the cache would have served
    runs at all)."""

    freed: float
    held: float
    hold: float
    miss: float
    lasting: float
    transient: float = 0.0
    call: float = 0.0

    def net(self, weight: float = 1.0) -> float:
        """Expected byte-seconds the fork saves, net (negative: it cannot pay); costs times ``weight``."""
        held = byte_seconds_net(0.0, 0.0, 0.0, self.held, self.hold, weight)  # the one cost model
        return self.freed + held - (self.miss + self.lasting + self.transient + self.call) * weight


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
    (``alpha``): ``fork_bytes`` what a fork holds beside its rollout, ``rollout_bytes`` what a rollout holds (both
    ``prior_bytes`` until measured: ``measured`` says whether they are), what a fork holds more than its rollout,
    measured in pairs (``observe_copy``; apart for rollouts that have committed a fork, ``copied_extra``, and those
    that have not, ``copy_extra``), ``miss_bytes`` what a discarded fork held at its end, its call's memory included
    (``observe_miss``; until measured: as much as a fork), and ``rollouts``, how long each rollout has to go."""

    def __init__(self, prior_bytes: float, alpha: float, rollout_seconds: float, clock: Callable[[], float]) -> None:
        self.alpha = alpha
        self.fork_bytes = Ewma(prior_bytes)
        self.rollout_bytes = Ewma(prior_bytes)
        self.copy_extra = Ewma(0.0)
        self.copied_extra = Ewma(0.0)
        self.miss_bytes: Ewma | None = None
        self.transient_bytes = Ewma(0.0)
        self.rollouts = RolloutClock(rollout_seconds, clock)
        self._pair: dict[str, float] = {}  # rollout -> its latest pair's difference since its last commit
        self._sizes: dict[str, tuple[float, float]] = {}  # rollout -> its latest pair: (fork bytes, its bytes)
        self._copies: set[str] = set()  # rollouts living in a committed fork's copy

    @property
    def measured(self) -> bool:
        """Whether a fork and a rollout have been measured (``observe_fork`` and ``observe_rollout``): before that
        their bytes are a prior, and a rule that compares them says nothing."""
        return self.fork_bytes.n > 0 and self.rollout_bytes.n > 0

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

    def observe_transient(self, memory_bytes: int) -> None:
        """What a fork held while it was made: its cgroup's peak when its call was about to start (the restore's
        CRIU and what it restored; the dump's CRIU, about as big, ran before it, in a cgroup of its own)."""
        if memory_bytes > 0:
            self.transient_bytes.add(float(memory_bytes), self.alpha)

    def terms(
        self,
        rollout: str,
        p: float,
        hidden: float,
        hold: float,
        straggler: float = 1.0,
        *,
        fork_seconds: float = 0.0,
        call: float = 0.0,
        miss_held: float | None = None,
    ) -> MemoryTerms:
        """``MemoryTerms`` of a fork for ``rollout``, used with probability ``p``, hiding ``hidden`` seconds of its
        call (as long as a miss's call runs before the ask), held ``hold`` seconds, ``fork_seconds`` of them in the
        making; ``straggler``: what the rollout's ending sooner frees, in rollouts' worth; ``call``: the
        byte-seconds a hit's call holds in the fork beyond the main line (``CallMemory.extra``); ``miss_held``: the
        byte-seconds a miss's call holds beyond its fork in the ``hidden`` seconds before the ask (its signature's,
        measured in forks, ``CallMemory.held_over``; None: ``miss_call_bytes`` for that long, what discarded forks'
        calls held, whatever they ran)."""
        fork, own = self.sizes(rollout)
        return MemoryTerms(
            freed=p * hidden * own * straggler,
            held=fork,
            hold=hold,
            miss=(1 - p) * (self.miss_call_bytes() * hidden if miss_held is None else miss_held),
            lasting=p * self.lasting(rollout),
            transient=self.transient_bytes.value * fork_seconds,
            call=p * call,
        )

    def sizes(self, rollout: str) -> tuple[float, float]:
        """(What a fork of ``rollout`` holds, what ``rollout`` holds): its own latest pair (``observe_copy``), else
        the run's running averages. Rollouts differ by far more than forks of one rollout do: on the real traces
        most held 0.2-0.6 MiB and their forks 0.1-0.2 MiB, one running a Python server 3.6 MiB, and a fork of it
        copies the server (3.4 MiB); weighed with the run's averages such a fork passed for a small one."""
        return self._sizes.get(rollout, (self.fork_bytes.value, self.rollout_bytes.value))

    def miss_call_bytes(self) -> float:
        """What a miss's call holds beyond its fork while it runs (``miss_bytes`` less ``fork_bytes``, at least 0): a
        hit's call holds the same on the main line, only earlier, so it is no cost of the fork; a miss's is."""
        miss = self.miss_bytes.value if self.miss_bytes is not None else 0.0
        return max(0.0, miss - self.fork_bytes.value)

    def observe_copy(self, copy_bytes: int, rollout_bytes: int, rollout: str = "") -> None:
        """Beside a fork of ``rollout``, before its call: what the fork holds (its processes, its layer) and what its
        rollout holds. A hit's copy replaces the rollout (whose upper dir then goes: the layer is its copy), so the
        difference is what a hit leaves the rollout for the rest of its life."""
        if copy_bytes > 0 and rollout_bytes > 0:
            extra = float(copy_bytes - rollout_bytes)
            (self.copied_extra if rollout in self._copies else self.copy_extra).add(extra, self.alpha)
            if rollout:
                self._pair[rollout] = extra
                self._sizes[rollout] = (float(copy_bytes), float(rollout_bytes))

    def committed(self, rollout: str) -> None:
        """``rollout`` moved into a fork's copy: its last pair compared the workspace it has left."""
        if rollout:
            self._copies.add(rollout)
            self._pair.pop(rollout, None)

    def done(self, rollout: str) -> None:
        self._copies.discard(rollout)
        self._pair.pop(rollout, None)
        self._sizes.pop(rollout, None)
        self.rollouts.done(rollout)

    def extra(self, rollout: str) -> float:
        """What a copy of ``rollout`` holds more than it (negative: less): its own latest pair since it last moved
        into a copy, else the mean of the rollouts in its state (never committed: a first copy; committed: a copy of
        a copy). By the kernel's counters a first copy of a small workspace holds less than the workspace it
        replaces, to the rollout's end (docs/benchmarks/speculation-history.md, session 18), a copy of a copy about
        as much."""
        if rollout in self._pair:
            return self._pair[rollout]
        return (self.copied_extra if rollout in self._copies else self.copy_extra).value

    def lasting(self, rollout: str) -> float:
        """Byte-seconds a hit's copy adds to ``rollout`` until it ends (negative: saves): ``extra`` x the rollout's
        expected remaining time. Hits that follow one another are each counted to the rollout's end; after the first
        the rollout is a copy, weighed with what copies of copies hold."""
        return self.extra(rollout) * self.rollouts.remaining(rollout)
