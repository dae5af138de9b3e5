"""The launch rule's memory side (``CostAwarePolicy.memory_net``): a fork weighed in the experiment's currency
(byte-seconds; GiB·s over 2**30), and what the runtime tells the policy to weigh it with. A concern of its own,
mixed into ``CostAwarePolicy``, which supplies the odds, the run and LLM times and the group's progress."""

from __future__ import annotations

from bunshin_async.speculation import CallKey, Launch

from ._allowance import Allowance
from ._callmemory import CallMemory
from ._memory import Ewma, ForkMemory, MemoryTerms

__all__ = ["MemoryWeighing"]


class MemoryWeighing:
    """``memory_net`` and its terms, and the ``observe_*`` calls that teach them (``ForkMemory``: a fork, its
    rollout, a committed copy, a miss, a fork's making; ``CallMemory``: a fork's call)."""

    memory: ForkMemory
    calls: CallMemory
    allowance: Allowance
    memory_weight: float
    fork_seconds: Ewma
    alpha: float
    straggler_weight: float

    def probability(self, option: Launch) -> float:
        raise NotImplementedError

    def expected_seconds(self, option: Launch) -> float:
        raise NotImplementedError

    def hideable(self, option: Launch) -> float:
        raise NotImplementedError

    def lag(self, rollout: str) -> float:
        raise NotImplementedError

    @property
    def weighs_measured(self) -> bool:
        """Whether a fork, a rollout and a fork's call have been measured: before that the rule's bytes are priors
        (or nothing), and forks launch one at a time (``Verdict.MEASURING``)."""
        return self.memory.measured and self.calls.measured

    def hold_seconds(self, option: Launch) -> float:
        """How long a fork for ``option`` exists beside its rollout, hit or miss: the fork itself, then until the
        model asks for the call (``hideable``), when a hit is committed and a miss still running cancelled."""
        return self.fork_seconds.value + self.hideable(option)

    def memory_net(self, option: Launch) -> float:
        """Expected byte-seconds a fork for ``option`` saves, net of what it holds (negative: it cannot pay)::

            freed - (held x hold_seconds + miss + lasting + transient + call) x memory_weight

        (``memory_terms``, ``MemoryTerms``): a hit frees the rollout's memory (the straggler's counts its group's
        share, ``straggler_weight``) the hidden seconds sooner; hit or miss, the fork holds its bytes beside the
        rollout's for ``hold_seconds``, and its making holds CRIU's for the fork's seconds; a miss's call holds its
        memory while it runs; a hit's call holds its memory in the fork for longer than on the main line
        (``CallMemory.extra``); a hit leaves the rollout the fork's copy to its end (``ForkMemory.lasting``: a
        first copy of a small workspace holds less)."""
        return self.memory_terms(option).net(self.memory_weight)

    def memory_terms(self, option: Launch, p: float | None = None, *, kernel: bool = False) -> MemoryTerms:
        """``memory_net``'s terms for ``option`` (with probability ``p`` of a hit: by default its own; ``kernel``:
        what a hit frees as the kernel counts it, without the straggler's weight). A miss's call holds what calls of
        its signature held in forks in as many seconds (``CallMemory.held_over``), else what discarded forks' calls
        held."""
        run = self.expected_seconds(option)
        hidden = min(run, self.hideable(option))
        straggler = 1.0 if kernel else 1 + self.straggler_weight * self.lag(option.rollout)
        return self.memory.terms(
            option.rollout, self.probability(option) if p is None else p, hidden, self.hold_seconds(option),
            straggler, fork_seconds=self.fork_seconds.value, call=self.calls.extra(option.key, run),
            miss_held=self.calls.held_over(option.key, hidden),
        )  # fmt: skip

    def outcome_costs(self, option: Launch) -> tuple[float, float]:
        """Byte-seconds a fork for ``option`` costs if it is used and if it is not (negative: it saves), as the
        kernel counts them (no straggler's weight, no ``memory_weight``): what the allowance is charged."""
        return -self.memory_terms(option, 1.0, kernel=True).net(), -self.memory_terms(option, 0.0, kernel=True).net()

    def memory_allows(self, option: Launch) -> bool:
        """The GiB·s rule: a fork that pays for itself in expectation (``memory_net`` >= 0), or one whose worse
        outcome fits what the run may still spend on speculation (``Allowance``)."""
        return self.memory_net(option) >= 0 or self.allowance.fits(*self.outcome_costs(option))

    def observe_fork(self, seconds: float, memory_bytes: int) -> None:
        if seconds > 0:
            self.fork_seconds.add(seconds, self.alpha)
        self.memory.observe_fork(memory_bytes)

    def observe_transient(self, memory_bytes: int) -> None:
        """What a fork held while it was made (``ForkMemory.observe_transient``)."""
        self.memory.observe_transient(memory_bytes)

    def observe_miss(self, memory_bytes: int) -> None:
        """What a discarded fork held at its end, its call's memory included (``ForkMemory.miss_call_bytes``)."""
        self.memory.observe_miss(memory_bytes)

    def observe_copy(self, copy_bytes: int, rollout_bytes: int, rollout: str = "") -> None:
        """A fork's and its rollout's bytes, side by side before its call (``ForkMemory.observe_copy``)."""
        self.memory.observe_copy(copy_bytes, rollout_bytes, rollout)

    def observe_rollout_memory(self, memory_bytes: int) -> None:
        """A rollout's footprint (its PSS, the page images it maps, its upper dir), to weigh forks' against."""
        self.memory.observe_rollout(memory_bytes)

    def observe_fork_call(self, key: CallKey, seconds: float, memory_bytes: int, byte_seconds: float = -1.0) -> None:
        """A call ran ``seconds`` in a fork, hit or miss (negative: cut short), raising its cgroup
        ``memory_bytes`` above its charge when it started and holding ``byte_seconds`` above it over its run
        (``CallMemory.observe_fork``); a run time that ended counts as a main-line call's does for ``saving``."""
        self.calls.observe_fork(key, seconds, memory_bytes, byte_seconds)
        if seconds >= 0:
            self.observe_call_seconds(key, seconds)

    def observe_call_seconds(self, key: CallKey, seconds: float) -> None:
        raise NotImplementedError
