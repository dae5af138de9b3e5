"""Predictors and speculation policy for Bunshin (built on ``bunshin_async``; it only knows their Protocols).

``default_speculation(group=task_id, table=shared_table)`` gives a ``Speculation`` with the stream tap (calls
start as soon as their arguments are complete), siblings (what other rollouts of the group did next from the same
history), observations (the module an import error names, filled into the calls that followed such errors, and
into the commands a README quoted), the rollout's own recent runs, the first run of a script it just wrote, the
next case of a run it steps through (``x.py 3`` after ``x.py 1``, ``x.py 2``), history (an n-gram model over call
signatures, optionally trained on traces), signatures (what that model says comes next, made concrete from the
group's calls) and user rules, under a cost-aware policy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import resources
from typing import Any

from bunshin_async._public import publish as _publish  # the SDK's helper: exported names carry this module
from bunshin_async.speculation import Policy, Predictor, Speculation

from ._decisions import Decision, Verdict, jsonl_sink
from ._kinds import KIND_ODDS, Guess, KindOdds, call_kind, fit_held_out, fit_odds, scored_guesses, with_kind_odds
from ._ngram import HistoryPredictor, NgramModel, SignaturePredictor
from ._observation import DocsPredictor, ObservationPredictor
from ._policy import CostAwarePolicy, cpu_contention, loop_load
from ._recent import RecentPredictor
from ._rules import OraclePredictor, Rule, RulePredictor
from ._runtimes import RunTimes, TimedPredictor
from ._siblings import SiblingPredictor, SiblingTable
from ._signature import command_program, signature
from ._steps import StepPredictor
from ._written import WrittenPredictor

__all__ = [
    "KIND_ODDS",
    "NGRAM_TABLE",
    "CostAwarePolicy",
    "Decision",
    "DocsPredictor",
    "HistoryPredictor",
    "KindOdds",
    "NgramModel",
    "ObservationPredictor",
    "OraclePredictor",
    "RecentPredictor",
    "Rule",
    "RulePredictor",
    "RunTimes",
    "SiblingPredictor",
    "SiblingTable",
    "SignaturePredictor",
    "StepPredictor",
    "TimedPredictor",
    "Verdict",
    "WrittenPredictor",
    "call_kind",
    "command_program",
    "cpu_contention",
    "loop_load",
    "default_guesses",
    "default_ngram",
    "default_speculation",
    "fit_odds",
    "held_out_odds",
    "jsonl_sink",
    "signature",
    "train_ngram",
    "with_kind_odds",
]

#: The package data ``default_ngram`` reads: what an order-3 ``NgramModel`` learned from the 500 public SWE-bench
#: trajectories of ``../shared/traces`` (``scripts/build_ngram_table.py`` rebuilds it).
NGRAM_TABLE = "ngram-swebench.json.gz"


def default_ngram() -> NgramModel:
    """The n-gram model the default predictor uses, read from package data (a compact table, ~ms; no trace file
    needed). Blocking."""
    data = resources.files(__name__).joinpath(NGRAM_TABLE).read_bytes()
    return NgramModel.from_table(data)


def train_ngram(path: str | os.PathLike[str], *, order: int = 3, limit: int | None = None) -> NgramModel:
    """An ``NgramModel`` trained on a trace file (``/work/shared/traces`` format or ``Trajectory`` records).
    Blocking (about a second for the public traces)."""
    model = NgramModel(order)
    model.train_file(path, limit)
    return model


def default_speculation(
    *,
    group: str = "",
    table: SiblingTable | None = None,
    model: NgramModel | None = None,
    rules: Iterable[Rule] = (),
    policy: Policy | None = None,
    extra: Sequence[Predictor] = (),
    tap: bool = True,
    without: Iterable[str] = (),
    times: RunTimes | None = None,
    odds: Mapping[str, Mapping[str, float]] | None = None,
) -> Speculation:
    """A ``Speculation`` for one rollout of ``group``: share ``table`` (and ``policy``, to share what it learns)
    among the rollouts of the group. ``tap=False`` waits for the message to end before running calls; ``without``
    leaves out the predictors of those names (an ablation). ``times``: run times by call signature (``RunTimes``,
    trained on timed traces of *other* tasks than those measured): each guess states its signature's where its
    predictor states none, so the policy does not take a kind of call it has not seen run yet for a short one.
    ``odds``: per predictor, odds factors by the kind of call guessed (``KindOdds``; default ``KIND_ODDS``, fitted on
    timed traces; ``{}``: the predictors' own odds). The rollouts sharing ``table`` share its ``signal``: a turn
    whose message still streams plans again when a sibling decides a call."""
    table = table if table is not None else SiblingTable()
    predictors: list[Predictor] = [
        SiblingPredictor(table),
        ObservationPredictor(table),
        DocsPredictor(),
        RecentPredictor(),
        WrittenPredictor(table),
        StepPredictor(),
    ]
    if model is not None:
        predictors += [HistoryPredictor(model), SignaturePredictor(model, table)]
    rule_list = list(rules)
    if rule_list:
        predictors.append(RulePredictor(rule_list))
    predictors.extend(extra)
    leave_out = set(without)
    predictors = with_kind_odds((p for p in predictors if p.name not in leave_out), KIND_ODDS if odds is None else odds)
    if times is not None:
        predictors = [TimedPredictor(p, times) for p in predictors]
    return Speculation(
        predictors=predictors, policy=policy if policy is not None else CostAwarePolicy(), group=group, early=tap,
        signal=table.signal,
    )  # fmt: skip


def held_out_odds(groups: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per task of ``groups`` (task -> its rollouts' trace records, ``/work/shared/traces`` format), odds factors by
    kind of call (``fit_odds``) fitted on the guesses ``default_speculation``'s predictors make on every *other*
    task (replayed offline, their own odds): what to pass as ``odds`` when measuring on those very traces, so that
    no task is measured with factors fitted on itself. Blocking (seconds for a few thousand calls)."""
    return fit_held_out(default_guesses(groups), groups)


def default_guesses(
    groups: Mapping[str, Sequence[Mapping[str, Any]]], model: Callable[[str], NgramModel | None] = lambda task: None
) -> list[Guess]:
    """Every guess ``default_speculation``'s predictors (their own odds; ``model(task)``: the n-gram model they use
    for that task, if any) make when ``groups`` are replayed offline, scored against the recorded next call."""
    from ._offline import Record

    records: dict[str, list[Record]] = {t: [dict(r) for r in rs] for t, rs in groups.items()}

    def make(task: str) -> Callable[[], Sequence[Predictor]]:
        table, ngram = SiblingTable(), model(task)
        return lambda: default_speculation(group=task, table=table, model=ngram, odds={}).predictors

    return scored_guesses(records, make)


_publish(__name__, globals())
