"""Launch planning: which predicted calls could start now, as pure functions over plain data (what the predictors
proposed, classified by the tools; what is in flight; the cache's veto), and the ``Planner`` that feeds them from a
turn (asks the predictors, remembers their guesses to score them when the call is decided).

The policy's ``select(options, running=..., forks=...)`` then gives its verdict over ``plan_launches``' options
within its budgets; the turn launches what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import msgspec

from .._exceptions import InvalidArgument
from .._tools._tools import Effect, Tool
from ._calls import CallKey, Candidate, Launch, PredictionContext, extend_chain
from ._handle import WorkspaceHandle
from ._metrics import TurnLog
from ._speculation import Speculation

__all__ = [
    "Classified",
    "KeepOption",
    "Planner",
    "choose_kept",
    "context_after",
    "plan_launches",
    "proposals",
    "scores",
]


class Classified(msgspec.Struct, frozen=True):
    """A predictor's ``candidate`` with what the turn's tools say of it: its canonical ``key`` (None: no such tool,
    or arguments the tool rejects), its ``effect`` class for these arguments and whether it is ``deterministic``."""

    candidate: Candidate
    key: CallKey | None
    effect: Effect
    deterministic: bool

    @property
    def speculable(self) -> bool:
        """A known, deterministic call that changes nothing outside its workspace: the only kind speculated."""
        return self.key is not None and self.effect is not Effect.EXTERNAL and self.deterministic


def plan_launches(
    predictions: Sequence[Classified],
    *,
    in_flight: Collection[CallKey] = (),
    veto: Callable[[Launch], bool] | None = None,
    turn_elapsed: float = 0.0,
    parent: Launch | None = None,
    rollout: str = "",
    progress: int = 0,
    group: str = "",
) -> list[Launch]:
    """The launches ``predictions`` allow, best first: speculable ones only, one per call (the most probable
    candidate's), none ``in_flight`` (a branch runs it already, or the main line will), none ``veto`` rejects. A
    launch after ``parent`` (a chain) is one call deeper and pays only if the parent's chain was right."""
    merged: dict[CallKey, Launch] = {}
    depth, prior = (0, 1.0) if parent is None else (parent.depth + 1, parent.probability)
    for p in predictions:
        if p.key is None or not p.speculable:
            continue
        cand, before = p.candidate, merged.get(p.key)
        if before is None or cand.probability > before.candidate.probability:
            merged[p.key] = Launch(
                candidate=cand, key=p.key, effect=p.effect, turn_elapsed=turn_elapsed, depth=depth, prior=prior,
                rollout=rollout, progress=progress, parent=parent, group=group,
            )  # fmt: skip
    return sorted(
        (o for k, o in merged.items() if k not in in_flight and (veto is None or not veto(o))),
        key=lambda o: -o.probability,
    )


def proposals(predictions: Sequence[Classified]) -> dict[str, dict[CallKey, float]]:
    """What each predictor (``source``) proposed, speculable or not launched alike: key -> probability."""
    out: dict[str, dict[CallKey, float]] = {}
    for p in predictions:
        if p.key is not None and p.speculable:
            out.setdefault(p.candidate.source, {})[p.key] = p.candidate.probability
    return out


def scores(
    proposed: Mapping[str, Mapping[CallKey, float]], wanted: Collection[CallKey | None]
) -> list[tuple[str, float, bool]]:
    """How each source's guesses for one call fared: (source, their summed probability capped at 1, whether one
    of them is ``wanted``: the call, or the command it filters)."""
    return [
        (source, min(1.0, sum(guesses.values())), any(k in guesses for k in wanted if k is not None))
        for source, guesses in proposed.items()
    ]


def context_after(ctx: PredictionContext, call: CallKey, output: str) -> PredictionContext:
    """The context of the call after ``call`` (made in ``ctx``, printing ``output``): what a chain predicts from."""
    return PredictionContext(
        history=(*ctx.history, call),
        chain=extend_chain(ctx.chain, call),
        turn=ctx.turn,
        position=ctx.position + 1,
        decided=(*ctx.decided, call),
        group=ctx.group,
        last_output=output,
    )


class KeepOption(msgspec.Struct, frozen=True):
    """An unused branch that could outlive its turn: ``chain`` is its id then its ancestors' up to the root (they
    must be kept with it: it starts from their state)."""

    done: bool
    probability: float
    chain: tuple[int, ...]


def choose_kept(alive: Sequence[KeepOption], limit: int) -> list[int]:
    """The ids of at most ``limit`` branches to hand to the next turn, with their ancestors (parents before
    children): finished ones first, then the likeliest."""
    keep: list[int] = []
    for option in sorted(alive, key=lambda o: (not o.done, -o.probability)):
        new = [c for c in option.chain if c not in keep]
        if len(keep) + len(new) <= limit:
            keep.extend(reversed(new))
    return keep


class Planner:
    """Asks a turn's predictors and turns their candidates into launch options (``plan_launches``); remembers what
    each predictor proposed for the next undecided call, scored when that call is decided (a policy learns its
    predictors' precision from every guess, launched or not)."""

    def __init__(
        self,
        handle: WorkspaceHandle,
        tools: Mapping[str, Tool],
        speculation: Speculation | None,
        log: TurnLog,
    ) -> None:
        self.handle, self.tools, self.speculation, self.log = handle, tools, speculation, log
        self.predicted: set[CallKey] = set()  # every distinct speculable candidate seen
        self._proposed: dict[int, dict[str, dict[CallKey, float]]] = {}  # position -> source -> key -> probability

    def key(self, name: str, args: Mapping[str, Any]) -> CallKey | None:
        tool = self.tools.get(name)
        if tool is None:
            return None
        try:
            return CallKey.of(tool, args)
        except InvalidArgument:
            return None

    def classify(self, name: str, args: Mapping[str, Any]) -> tuple[CallKey | None, Effect, bool]:
        """(key, effect, deterministic) of a call; an unknown or invalid call is an external one."""
        key = self.key(name, args)
        if key is None:
            return None, Effect.EXTERNAL, False
        cls = self.tools[name].classify_call(key.arguments())
        return key, cls.effect, cls.deterministic

    def context(self, position: int, decided: Sequence[CallKey], *, ahead: bool = False) -> PredictionContext:
        """The context of call ``position`` of the message, ``decided`` being the calls before it (``ahead``: of the
        next turn's message, which has not started)."""
        return PredictionContext(
            history=tuple(self.handle.history),
            chain=self.handle.chain,
            turn=self.log.metrics.turn + (1 if ahead else 0),
            position=position,
            decided=tuple(decided),
            group=self.speculation.group if self.speculation else "",
            last_output=self.handle.last_output,
        )

    def options(
        self,
        ctx: PredictionContext,
        *,
        exclude: Collection[CallKey],
        parent: Launch | None = None,
        ahead: bool = False,
    ) -> list[Launch]:
        """The predictors' candidates for ``ctx`` as launches (``plan_launches``); ``Speculation.skip`` vetoes
        only the next call itself (the cache's veto judges the current state, not a chain's). ``ahead``: ``ctx`` is
        the next turn's (not started: no LLM time of it has passed; its own planner scores the guesses)."""
        spec = self.speculation
        assert spec is not None
        predictions = [
            Classified(cand, *self.classify(cand.name, cand.arguments))
            for predictor in spec.predictors
            for cand in predictor.predict(ctx)
        ]
        self.predicted.update(p.key for p in predictions if p.key is not None and p.speculable)
        if parent is None and not ahead:
            table = self._proposed.setdefault(ctx.position, {})
            for source, guesses in proposals(predictions).items():
                table.setdefault(source, {}).update(guesses)
        return plan_launches(
            predictions, in_flight=exclude, veto=spec.skip if parent is None else None, parent=parent,
            turn_elapsed=0.0 if ahead else self.log.clock() - self.log.t0, rollout=self.handle.name,
            progress=len(ctx.history), group=spec.group,
        )  # fmt: skip

    def score(self, position: int, wanted: Collection[CallKey | None]) -> None:
        """Tell the policy (if it learns precision: ``observe_prediction``) how each predictor's guesses for call
        ``position`` fared."""
        proposed = self._proposed.pop(position, {})
        observe = getattr(self.speculation.policy, "observe_prediction", None) if self.speculation else None
        if observe is None:
            return
        for source, probability, hit in scores(proposed, wanted):
            observe(source, probability, hit)
