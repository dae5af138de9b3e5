"""Predictors the user writes: regex ``Rule``s (``RulePredictor``) and a fixed script (``OraclePredictor``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from bunshin_async.speculation import CallKey, Candidate, PredictionContext

__all__ = [
    "OraclePredictor",
    "Rule",
    "RulePredictor",
]


class Rule(msgspec.Struct, frozen=True, kw_only=True):
    """After a call whose ``after_tool`` matches and whose ``after`` regex matches its command (or its JSON
    arguments), predict ``then`` (a tool name and arguments) with ``probability``. ``after=None`` with
    ``at_start=True`` fires for the first call of a rollout. ``expected_seconds`` tells the policy how long the
    predicted call runs (unknown calls otherwise get the policy's prior)."""

    then_tool: str
    then_args: dict[str, Any]
    probability: float = 0.9
    after: str | None = None
    after_tool: str | None = None
    at_start: bool = False
    expected_seconds: float | None = None


class RulePredictor:
    """User rules (``Rule``), or any callables ``ctx -> candidates``."""

    name = "rules"

    def __init__(self, rules: Iterable[Rule | Callable[[PredictionContext], Sequence[Candidate]]] = ()) -> None:
        self.rules = list(rules)
        self._compiled: dict[str, re.Pattern[str]] = {}

    def _fires(self, rule: Rule, ctx: PredictionContext) -> bool:
        if not ctx.history:
            return rule.at_start
        last = ctx.history[-1]
        if rule.after_tool is not None and last.name != rule.after_tool:
            return False
        if rule.after is None:
            return not rule.at_start
        pattern = self._compiled.setdefault(rule.after, re.compile(rule.after))
        args = last.arguments()
        text = args.get("command") if isinstance(args.get("command"), str) else last.args.decode()
        return pattern.search(str(text)) is not None

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        out: list[Candidate] = []
        for rule in self.rules:
            if isinstance(rule, Rule):
                if self._fires(rule, ctx):
                    out.append(
                        Candidate(
                            name=rule.then_tool,
                            arguments=dict(rule.then_args),
                            probability=rule.probability,
                            source=self.name,
                            expected_seconds=rule.expected_seconds,
                        )
                    )
            else:
                out.extend(rule(ctx))
        return out

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass


class OraclePredictor:
    """Told the rollout's true calls (``script``: tool name and arguments, in order): predicts the next one with
    probability 1 (after a chain of speculated calls, the one after them). The experiment's ``oracle``
    configuration uses it to bound what speculation can buy."""

    name = "oracle"

    def __init__(self, script: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        self.script = [(name, dict(args)) for name, args in script]

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        n = len(ctx.history)
        if n >= len(self.script):
            return []
        name, args = self.script[n]
        return [Candidate(name=name, arguments=args, probability=1.0, source=self.name)]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass
