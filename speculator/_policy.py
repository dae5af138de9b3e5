"""The speculation policy: which candidates to launch, by expected saving against cost, under a budget."""

from __future__ import annotations

from collections.abc import Sequence

from bunshin_async.speculation import CallKey, Launch

from ._signature import signature

__all__ = ["CostAwarePolicy"]


class _Ewma:
    __slots__ = ("value", "n")

    def __init__(self, value: float) -> None:
        self.value, self.n = value, 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.n == 0 else (1 - alpha) * self.value + alpha * x
        self.n += 1


class CostAwarePolicy:
    """Launch a candidate when ``probability x expected latency`` beats its cost, best saving first.

    Expected latency: the exact call's own running average if it ran before, else its signature's
    (``tool:program``), else the candidate's ``expected_seconds``, else ``default_seconds``; all learned online.
    Cost: a fork's measured seconds (running average, ``fork_seconds`` before the first) times ``fork_weight``
    (the fork also holds the workspace for that long); in-place reads cost ``read_cost``. Budgets: at most
    ``max_branches`` running, ``max_forks`` forks, and forks' estimated memory within ``memory_budget`` bytes.
    One policy may serve many rollouts (share it to share what it learned).
    """

    def __init__(
        self,
        *,
        max_branches: int = 4,
        max_forks: int = 2,
        memory_budget: int = 2 << 30,
        default_seconds: float = 0.3,
        fork_seconds: float = 0.2,
        fork_bytes: int = 32 << 20,
        fork_weight: float = 1.0,
        read_cost: float = 0.002,
        min_probability: float = 0.05,
        alpha: float = 0.3,
    ) -> None:
        self.max_branches = max_branches
        self.max_forks = max_forks
        self.memory_budget = memory_budget
        self.default_seconds = default_seconds
        self.fork_weight = fork_weight
        self.read_cost = read_cost
        self.min_probability = min_probability
        self.alpha = alpha
        self.fork_seconds = _Ewma(fork_seconds)
        self.fork_bytes = _Ewma(float(fork_bytes))
        self._exact: dict[CallKey, _Ewma] = {}
        self._sig: dict[str, _Ewma] = {}

    def expected_seconds(self, option: Launch) -> float:
        exact = self._exact.get(option.key)
        if exact is not None:
            return exact.value
        sig = self._sig.get(signature(option.key.name, option.key.arguments()))
        if sig is not None:
            return sig.value
        if option.candidate.expected_seconds is not None:
            return option.candidate.expected_seconds
        return self.default_seconds

    def saving(self, option: Launch) -> float:
        """Expected seconds saved, net of cost."""
        gain = option.candidate.probability * self.expected_seconds(option)
        cost = self.fork_seconds.value * self.fork_weight if option.needs_fork else self.read_cost
        return gain - cost

    def select(self, options: Sequence[Launch], *, running: int, forks: int) -> list[Launch]:
        ranked = sorted(
            ((self.saving(o), o) for o in options if o.candidate.probability >= self.min_probability),
            key=lambda x: -x[0],
        )
        out: list[Launch] = []
        for gain, option in ranked:
            if gain <= 0 or running >= self.max_branches:
                break
            if option.needs_fork:
                if forks >= self.max_forks or (forks + 1) * self.fork_bytes.value > self.memory_budget:
                    continue
                forks += 1
            running += 1
            out.append(option)
        return out

    def observe_tool(self, key: CallKey, seconds: float) -> None:
        self._exact.setdefault(key, _Ewma(seconds)).add(seconds, self.alpha)
        sig = signature(key.name, key.arguments())
        self._sig.setdefault(sig, _Ewma(seconds)).add(seconds, self.alpha)

    def observe_fork(self, seconds: float, memory_bytes: int) -> None:
        if seconds > 0:
            self.fork_seconds.add(seconds, self.alpha)
        if memory_bytes > 0:
            self.fork_bytes.add(float(memory_bytes), self.alpha)
