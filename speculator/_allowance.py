"""Speculation's memory allowance: how many byte-seconds the launch rule may spend on forks that do not pay for
themselves in expectation, so that a configuration with speculation holds no more than a small share more than
the same configuration without it (issue 38: "never worse in GiB·s than fork+cache").

By the kernel's counters a hit frees little memory on the real traces: a rollout idles at 0.2-0.8 MiB, so hiding a
second frees a fraction of a MiB·s, while a miss's call (a ``pip install``'s 40 MiB, a Python script's) holds its memory
for the seconds it runs before the ask (docs/benchmarks/speculation-history.md, session 19). Weighed one by one, a fork
for any call that holds memory cannot pay, and the rule refused nearly everything the predictors offered. The
allowance lets a run spend what it can afford instead: ``share`` of what its rollouts hold (``earned``: their
measured footprint for their running seconds), plus what its hits saved; each fork is charged the larger of its two
outcomes' costs when it launches and its outcome's when it is released, so the forks in flight can all miss and the
run still stay within it. The rollouts' footprint leaves out their calls (a call's bytes are a peak, and a padded
call holds its peak for a fraction of its seconds): on the long-tool groups it is about a fifth of what fork+cache
holds in all, so a share of 0.1 is about 2% of that, within the spread of its repeats (2-6%)."""

from __future__ import annotations

from collections.abc import Callable

from bunshin_async.speculation import Launch

__all__ = ["Allowance"]


def _id(launch: Launch) -> tuple[str, bytes, str, int]:
    return launch.rollout, launch.key.args, launch.key.name, launch.depth


class Allowance:
    """Byte-seconds speculation may still spend (``balance``): ``share`` of ``earned`` (what the run's rollouts
    held so far, ``observe_rollouts``) less what settled forks cost (a hit's
    cost is negative where it saved more than it held) and the worst case of those in flight (``charge``,
    ``settle``). Bounded by the forks in flight."""

    def __init__(self, share: float, clock: Callable[[], float]) -> None:
        self.share = share
        self.clock = clock
        self.earned = 0.0
        self.spent = 0.0
        self._at: float | None = None
        self._pending: dict[tuple[str, bytes, str, int], list[tuple[float, float]]] = {}

    @property
    def balance(self) -> float:
        held = sum(max(hit, miss) for charges in self._pending.values() for hit, miss in charges)
        return self.share * self.earned - self.spent - held

    def fits(self, hit: float, miss: float) -> bool:
        """Whether a fork whose hit would cost ``hit`` byte-seconds and miss ``miss`` fits the balance, whichever
        it turns out to be. Never with a ``share`` of 0: the rule is then each fork's own (it pays, or it is not
        launched)."""
        return self.share > 0 and max(hit, miss) <= self.balance

    def observe_rollouts(self, rollouts: int, memory_bytes: float) -> None:
        """``rollouts`` rollouts run now, each holding about ``memory_bytes``: since the last reading they held
        that much each (a run's rollouts idle most of the time: their footprint is most of their memory)."""
        now = self.clock()
        if self._at is not None and now > self._at:
            self.earned += rollouts * memory_bytes * (now - self._at)
        self._at = now

    def charge(self, launch: Launch, hit: float, miss: float) -> None:
        """A fork for ``launch`` was launched: its costs, byte-seconds, if it is used (``hit``) or not (``miss``)."""
        self._pending.setdefault(_id(launch), []).append((hit, miss))

    def forget(self, rollout: str) -> None:
        """``rollout`` ended: drop what its forks still hold charged (a launch whose branch never started is never
        released, and would lower the balance for the rest of the run)."""
        for key in [k for k in self._pending if k[0] == rollout]:
            del self._pending[key]

    def settle(self, launch: Launch, used: bool) -> None:
        """The fork for ``launch`` ended, ``used`` or not: its outcome's cost replaces its worst case."""
        charges = self._pending.get(_id(launch))
        if not charges:
            return
        hit, miss = charges.pop(0)
        if not charges:
            del self._pending[_id(launch)]
        self.spent += hit if used else miss
