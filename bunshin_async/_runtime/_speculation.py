"""What a turn speculates with: ``Speculation`` (predictors, policy, group, lead time, kept branches) and the
fallback ``BoundedPolicy``; ``speculator`` has the cost-aware policy."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from ._calls import CallKey, Launch, Policy, Predictor
from ._metrics import RolloutMetrics, TurnMetrics

__all__ = ["BoundedPolicy", "GroupSignal", "LiveForks", "Speculation", "policy_active", "policy_keeps"]

log = logging.getLogger("bunshin_async.speculation")


class GroupSignal:
    """The rollouts of a group tell each other when one decides a call (``notify``), so that those whose message
    still streams plan their next call again (``subscribed``): a sibling's decision is new evidence for their
    predictors (what the group did next from the same state). Pass one to each rollout's ``Speculation`` of the
    group. Callbacks are given the call and the state it was decided in (``PredictionContext.chain``); they run in
    the notifying turn's task, on the same event loop, and must not block. A re-plan is advisory: one that raises
    (a sibling's predictor or policy) is logged and the others still run, so that it never fails the notifying
    rollout's turn; only what is not an ``Exception`` (a cancellation) goes on up."""

    def __init__(self) -> None:
        self._subscribers: dict[int, tuple[object, Callable[[CallKey, bytes], None]]] = {}

    @contextmanager
    def subscribed(self, owner: object, callback: Callable[[CallKey, bytes], None]) -> Iterator[None]:
        """Call ``callback`` on every sibling's decision (not ``owner``'s own) until the block ends."""
        self._subscribers[id(owner)] = (owner, callback)
        try:
            yield
        finally:
            self._subscribers.pop(id(owner), None)

    def notify(self, owner: object, call: CallKey, state: bytes) -> None:
        """``owner`` decided ``call`` in ``state``: every other subscriber plans again."""
        for who, callback in list(self._subscribers.values()):
            if who is not owner:
                try:
                    callback(call, state)
                except Exception:
                    log.warning("a sibling's re-plan after %s failed; it goes on without it", call.name, exc_info=True)


class LiveForks:
    """The forks a policy selected that the runtime has not released yet (``Policy.release``), per rollout: every
    fork that exists, those still closing included. A turn's ``forks`` count (what ``select`` is given) shows only
    its live branches; inside ``handle.background()`` the forks a finished turn let go close in the handle's task
    group while the next turn already selects, so a policy that bounds forks counts them here, from its ``select``
    (``add``) to its ``release`` (``remove``). Both policies use it: ``BoundedPolicy`` and ``speculator``'s."""

    def __init__(self) -> None:
        self._live: dict[str, int] = {}

    def add(self, launch: Launch) -> None:
        if launch.needs_fork:
            self._live[launch.rollout] = self._live.get(launch.rollout, 0) + 1

    def remove(self, launch: Launch) -> None:
        if launch.needs_fork and self._live.get(launch.rollout, 0) > 0:
            self._live[launch.rollout] -= 1

    def of(self, rollout: str) -> int:
        """Forks of ``rollout`` selected and not released."""
        return self._live.get(rollout, 0)

    def total(self) -> int:
        """Forks of every rollout selected and not released (a group sharing the policy)."""
        return sum(self._live.values())

    def forget(self, rollout: str) -> None:
        """``rollout`` ended (``Policy.rollout_done``)."""
        self._live.pop(rollout, None)


class BoundedPolicy:
    """The fallback policy: launch the most probable options while fewer than ``max_branches`` run and fewer than
    ``max_forks`` forks exist, if their probability is at least ``min_probability`` and they are at most
    ``max_depth`` speculated calls deep. The forks counted are the rollout's that exist: the turn's and those a
    finished turn's branches still close (``LiveForks``, until ``release``). ``speculator`` has the cost-aware
    one."""

    def __init__(
        self, max_branches: int = 2, max_forks: int = 1, min_probability: float = 0.0, max_depth: int = 1
    ) -> None:
        self.max_branches, self.max_forks, self.min_probability = max_branches, max_forks, min_probability
        self.max_depth = max_depth
        self.live = LiveForks()

    def select(self, options: Sequence[Launch], *, running: int, forks: int) -> list[Launch]:
        out: list[Launch] = []
        for option in options:
            if running >= self.max_branches:
                break
            if option.probability < self.min_probability or option.depth > self.max_depth:
                continue
            if option.needs_fork:
                if max(forks, self.live.of(option.rollout)) >= self.max_forks:
                    continue
                forks += 1
                self.live.add(option)
            running += 1
            out.append(option)
        return out

    def release(self, launch: Launch, used: bool) -> None:
        """A branch this policy selected ended (its fork, if any, closed)."""
        self.live.remove(launch)

    def rollout_done(self, rollout: str) -> None:
        self.live.forget(rollout)

    def observe_tool(self, key: CallKey, seconds: float) -> None:
        pass

    def observe_fork(self, seconds: float, memory_bytes: int) -> None:
        pass


@dataclass
class Speculation:
    """What to speculate with: ``predictors`` (asked at every decision point), the ``policy`` that chooses
    launches, ``group`` (rollouts that share a sibling table pass the same name), and ``early``: start a call
    as soon as the tap saw its arguments complete (the stream tap as a predictor of certainty). ``skip`` vetoes
    launches (pass one that says whether the prefix cache would serve the call: such calls are not speculated).
    One ``Speculation`` may serve many turns and rollouts: the policy learns across them; ``metrics`` sums the
    turns run with it (make one per rollout, sharing the policy and the predictors' tables, to get per-rollout
    metrics) and ``turns`` keeps each turn's own metrics, in order.

    Chains: when a speculated write finishes in its fork before the model asked for it, the predictors are asked
    for the call after it (their context extended by that call and its output) and what the policy picks runs in
    a fork of that branch (a read in the branch's fork itself); committing a branch makes its children branches of
    the new state. ``keep``: inside ``handle.background()`` (``run_agent``), at most this many unused branches
    (their chains included) outlive their turn while no state change happened since they started: a later turn
    commits them when the model asks for their call; any committed write discards them. Their forks count against
    the policy's fork budget, and a policy with ``keeps(launch)`` lets go of those it says cannot pay for another
    turn (``TurnMetrics.released``).

    ``on_observation`` (with kept branches): once every call of a message has its result, the calls predicted to
    open the next turn are launched at once, before this turn's cleanup, the agent loop's bookkeeping and the next
    model request, instead of when the next turn starts; the next turn adopts them (beyond ``keep``) and commits,
    keeps or cancels them as any kept branch. False: the next turn's first call is predicted when that turn
    starts.

    ``signal``: the group's ``GroupSignal`` (one per group, shared by its rollouts' ``Speculation``): while this
    turn's message streams it plans its next call again whenever a sibling decides one, with what the
    predictors learned from it (otherwise it plans at the turn's start and after its own decisions only)."""

    predictors: Sequence[Predictor] = ()
    policy: Policy = field(default_factory=BoundedPolicy)
    group: str = ""
    early: bool = True
    skip: Callable[[Launch], bool] | None = None
    keep: int = 2
    on_observation: bool = True
    metrics: RolloutMetrics = field(default_factory=RolloutMetrics)
    turns: list[TurnMetrics] = field(default_factory=list)
    signal: GroupSignal | None = None


def policy_active(spec: Speculation) -> bool:
    """The policy wants launches considered now (``Policy.active``, where it has one)."""
    active = getattr(spec.policy, "active", None)
    return active is None or bool(active())


def policy_keeps(spec: Speculation | None, launch: Launch) -> bool:
    """The policy would keep an unused branch for ``launch`` into the next turn (``Policy.keeps``, where it has one:
    a kept fork is held at least another LLM turn, which its expected use may not pay for)."""
    keeps = getattr(spec.policy, "keeps", None) if spec is not None else None
    return keeps is None or bool(keeps(launch))
