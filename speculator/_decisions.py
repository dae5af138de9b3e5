"""What the cost-aware policy decided about each option and why: one ``Decision`` per option ``select`` (or
``keeps``) was given, with the rule that refused it and the figures the rule weighed. For diagnosis: which rule
keeps a workload's guesses from launching (``CostAwarePolicy(decisions=...)``, the experiment's ``--decisions``)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import IO, Protocol

import msgspec

from bunshin_async.speculation import Launch

from ._allowance import Allowance
from ._memory import MemoryTerms

__all__ = ["Decision", "Verdict", "decision", "jsonl_sink"]


class Verdict(enum.Enum):
    """What became of an option, and by which rule (the first that refused it, in ``select``'s order)."""

    LAUNCH = "launch"
    PROBABILITY = "probability"  # calibrated probability below ``min_probability``
    DEPTH = "depth"  # chained deeper than ``max_depth``
    SAVING = "saving"  # expected seconds saved, net of fork time and a miss's CPU (``saving``), not positive
    BRANCHES = "branches"  # ``max_branches`` running
    FORKS = "forks"  # ``max_forks`` forks, or ``memory_budget``
    MEMORY = "memory"  # the GiB·s rule (``memory_net`` < 0)
    GROUP = "group"  # the group's forks in flight (``group_forks``, the straggler's reserve)
    MEASURING = "measuring"  # nothing measured yet: one fork at a time, measured when it is ready
    KEEP = "keep"  # ``keeps``: worth holding into the next turn
    RELEASE = "release"  # ``keeps``: not worth it


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """One option's verdict and the figures it was judged by: ``p`` calibrated (``p_stated`` as the predictor said),
    ``run`` the expected run time, ``hideable`` the LLM time it could hide, ``saving`` the net expected seconds,
    ``load`` the CPU contention charged; for a fork, the GiB·s rule's verdict in byte-seconds (``memory_net``), its
    terms (``memory``) and what the run's allowance had left when it was judged (``allowance``, ``Allowance``)."""

    t: float
    verdict: Verdict
    rollout: str
    group: str
    source: str
    call: str
    p_stated: float
    p: float
    depth: int
    fork: bool
    turn_elapsed: float
    run: float
    hideable: float
    saving: float
    load: float
    memory_net: float | None = None
    memory: MemoryTerms | None = None
    allowance: float | None = None


_encoder = msgspec.json.Encoder()


def jsonl_sink(out: IO[bytes]) -> Callable[[Decision], None]:
    """A ``decisions`` callback that writes each decision to ``out`` as a JSON line."""

    def write(d: Decision) -> None:
        out.write(_encoder.encode(d) + b"\n")

    return write


class _Judge(Protocol):
    """What ``decision`` reads of the policy (``CostAwarePolicy``)."""

    clock: Callable[[], float]

    def probability(self, option: Launch) -> float: ...
    def expected_seconds(self, option: Launch) -> float: ...
    def hideable(self, option: Launch) -> float: ...
    def memory_terms(self, option: Launch) -> MemoryTerms: ...
    def memory_net(self, option: Launch) -> float: ...
    @property
    def allowance(self) -> Allowance: ...
    @property
    def load(self) -> float: ...


def decision(policy: _Judge, option: Launch, verdict: Verdict, saving: float) -> Decision:
    """``option``'s verdict with the figures ``policy`` judged it by."""
    terms = policy.memory_terms(option) if option.needs_fork else None
    rounded = None if terms is None else MemoryTerms(*(round(x, 3) for x in msgspec.structs.astuple(terms)))
    return Decision(
        t=round(policy.clock(), 3), verdict=verdict, rollout=option.rollout, group=option.group,
        source=option.candidate.source, call=_short(option), p_stated=round(option.probability, 4),
        p=round(policy.probability(option), 4), depth=option.depth, fork=option.needs_fork,
        turn_elapsed=round(option.turn_elapsed, 3), run=round(policy.expected_seconds(option), 3),
        hideable=round(policy.hideable(option), 3), saving=round(saving, 4), load=round(policy.load, 3),
        memory_net=None if terms is None else round(policy.memory_net(option)), memory=rounded,
        allowance=None if terms is None else round(policy.allowance.balance),
    )  # fmt: skip


def _short(option: Launch, limit: int = 160) -> str:
    args = option.key.arguments()
    text = args.get("command") if isinstance(args.get("command"), str) else option.key.args.decode(errors="replace")
    return f"{option.key.name}: {text}"[:limit]
