"""Odds by the kind of call: a predictor's stated probability, corrected for the kind of call it guesses (an
install, an edit, a read, a run), as fitted on timed multi-rollout traces.

A predictor states one probability per level of evidence, whatever the call: on the terminal-benchmark traces
``siblings``' guess after the same previous call (stated 0.2-0.5) was the next call about twice as often when it
was a run (a script, a build) as when it was an edit, and installs it guessed rarely came (the rollouts of a group
install the same thing once, at about the same time). The policy launches by *probability x hideable seconds*, so
underrated long runs are refused and overrated edits forked. ``KindOdds`` multiplies each guess's odds
(``p / (1 - p)``) by its (predictor, kind) factor; ``fit_odds`` fits those factors from scored guesses, each by
maximum likelihood with a Gaussian prior on the log factor (few guesses keep a factor near 1).
``scripts/eval_predictors.py --kinds`` refits them and checks them leave-task-out (each task's guesses under the
factors fitted on the other tasks)."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from bunshin_async.speculation import CallKey, Candidate, PredictionContext, Predictor

from ._offline import Record, _calls, evaluate
from ._signature import command_program, installer
from ._wrapped import Wrapped

__all__ = [
    "KINDS",
    "KIND_ODDS",
    "Guess",
    "KindOdds",
    "call_kind",
    "fit_held_out",
    "fit_odds",
    "scored_guesses",
    "shift_odds",
    "with_kind_odds",
]

#: A scored guess: (task, source, kind, stated probability, whether it was the next call).
Guess = tuple[str, str, str, float, bool]

#: The kinds, in the order tables print them; ``other``: a call without a shell command.
KINDS = ("install", "edit", "read", "run", "other")

# Programs that only look (what the shell's ``ls``, ``cat`` print).
_READS = frozenset(
    "ls cat head tail grep egrep rg find which whereis pwd echo printf file wc ps du df tree stat env printenv "
    "whoami id uname hexdump xxd od less more diff cmp type readlink realpath nproc free date history".split()
)
# Programs that change files without computing much (``mkdir``, ``mv``; a ``sed -i``).
_MUTATES = frozenset("mkdir mv cp rm touch chmod chown ln tee".split())
# Text filters: redirected into a file, they write it (``sed 's/a/b/' x.py > y.py``) as ``cat`` or ``echo`` do.
_FILTERS = frozenset("sed awk sort uniq cut tr jq base64 gzip zcat".split())


def call_kind(name: str, arguments: Mapping[str, Any]) -> str:
    """``install`` (a package manager installs), ``edit`` (a heredoc, ``cat``, ``echo`` or a filter redirected into a
    file, ``sed -i``, ``mkdir``, ``mv`` ...), ``read`` (``ls``, ``cat``, ``grep`` ...), ``run`` (anything else a shell
    runs: a script, a build, a server, also with its output redirected: ``python3 train.py > log`` computes) or
    ``other`` (no ``command`` argument)."""
    command = arguments.get("command", arguments.get("cmd"))
    if not isinstance(command, str):
        return "other"
    if installer(command) is not None:
        return "install"
    program = command_program(command)
    first = command.strip().split("\n", 1)[0]
    word = program.split(" ", 1)[0]
    redirected = program.endswith(" >") and (word in _READS or word in _FILTERS)
    if redirected or ("<<" in first and ">" in first) or re.search(r"\bsed\s+-i", command) or word in _MUTATES:
        return "edit"
    return "read" if word in _READS else "run"


#: Odds factors by predictor and kind, fitted on the 26 tasks of the terminal-benchmark development traces
#: (``scripts/eval_predictors.py TRACES --kinds``; 2026-12-04). A kind a predictor is absent from keeps its odds.
KIND_ODDS: dict[str, dict[str, float]] = {
    "recent": {"run": 1.08},
    "siblings": {"edit": 0.37, "install": 0.5, "read": 1.24, "run": 2.17},
    "steps": {"run": 1.37},
    "written": {"edit": 0.45, "read": 0.84},
}


def shift_odds(p: float, factor: float) -> float:
    """``p`` with its odds multiplied by ``factor`` (0 and 1 stay)."""
    if p <= 0.0 or p >= 1.0:
        return p
    return factor * p / (1.0 - p + factor * p)


class KindOdds(Wrapped):
    """``inner``'s guesses, each with its odds multiplied by ``factors[kind]`` (``call_kind``); a guess whose source
    ``by_source`` names (a predictor's second source, ``ObservationPredictor.form_source``) by that source's."""

    def __init__(
        self, inner: Predictor, factors: Mapping[str, float], by_source: Mapping[str, Mapping[str, float]] | None = None
    ) -> None:
        super().__init__(inner)
        self.factors = dict(factors)
        self.by_source = {source: dict(f) for source, f in (by_source or {}).items()}

    def candidate(self, ctx: PredictionContext, c: Candidate) -> Candidate:
        factor = self.by_source.get(c.source, self.factors).get(call_kind(c.name, c.arguments), 1.0)
        return c if factor == 1.0 else msgspec.structs.replace(c, probability=shift_odds(c.probability, factor))


def with_kind_odds(predictors: Iterable[Predictor], odds: Mapping[str, Mapping[str, float]]) -> list[Predictor]:
    """Each of ``predictors`` that ``odds`` has factors for (by its name, or by another source its guesses carry,
    listed in its ``sources``), wrapped in ``KindOdds``."""
    out: list[Predictor] = []
    for p in predictors:
        others = {s: odds[s] for s in getattr(p, "sources", ()) if odds.get(s)}
        out.append(KindOdds(p, odds.get(p.name, {}), others) if odds.get(p.name) or others else p)
    return out


def fit_odds(
    guesses: Iterable[tuple[str, str, float, bool]], *, prior: float = 0.5, floor: float = 0.05
) -> dict[str, dict[str, float]]:
    """Per (source, kind), the odds factor that makes ``source``'s guesses of that kind most likely: guesses are
    ``(source, kind, stated probability, hit)``; guesses stated under ``floor`` are left out (the policy never
    launches them, and their many misses would decide the fit); ``prior``: the standard deviation of a Gaussian
    prior on the natural log of the factor (a factor of e^prior is one standard deviation away from 1; 0.5 gave the
    lowest held-out log loss on the terminal-benchmark traces of 0.25, 0.5, 0.75, 1 and 1.5)."""
    cells: dict[tuple[str, str], list[tuple[float, bool]]] = defaultdict(list)
    for source, kind, p, hit in guesses:
        if floor <= p < 1.0:
            cells[source, kind].append((p, hit))
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (source, kind), rows in sorted(cells.items()):
        log_factor = _fit(rows, prior)
        if abs(log_factor) >= 0.05:  # within 5% of 1: leave the odds as they are
            out[source][kind] = round(math.exp(log_factor), 2)
    return dict(out)


def fit_held_out(guesses: Sequence[Guess], tasks: Iterable[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Per task, the factors ``fit_odds`` fits on the ``guesses`` of every *other* task (``Guess``: task first)."""
    return {task: fit_odds(g[1:] for g in guesses if g[0] != task) for task in tasks}


def _fit(rows: Sequence[tuple[float, bool]], prior: float) -> float:
    """The log odds factor maximising the guesses' Bernoulli likelihood plus the prior (Newton's method on a
    concave objective, from 0)."""
    x = 0.0
    for _ in range(50):
        grad, hess = -x / prior**2, -1.0 / prior**2
        for p, hit in rows:
            q = shift_odds(p, math.exp(x))
            grad += (1.0 if hit else 0.0) - q
            hess -= q * (1.0 - q)
        step = grad / hess
        x -= max(-1.0, min(1.0, step))
        if abs(step) < 1e-6:
            break
    return x


class _Scoring(Wrapped):
    """``inner``, each of its guesses recorded with the call that came (``Guess``)."""

    def __init__(self, inner: Predictor, task: str, calls: Sequence[CallKey], out: list[Guess]) -> None:
        super().__init__(inner)
        self.task, self.calls, self.out = task, calls, out

    def candidate(self, ctx: PredictionContext, c: Candidate) -> Candidate:
        truth = self.calls[len(ctx.history)]
        key = CallKey(c.name, truth.version, msgspec.json.encode(c.arguments, order="deterministic"))
        self.out.append((self.task, c.source, call_kind(c.name, c.arguments), c.probability, key == truth))
        return c


def scored_guesses(
    groups: Mapping[str, Sequence[Record]], make: Callable[[str], Callable[[], Sequence[Predictor]]]
) -> list[Guess]:
    """Every guess the predictors ``make(task)()`` gives (one rollout's, as for ``_offline.evaluate``) make when
    ``groups`` are replayed offline, scored against the recorded next call."""
    out: list[Guess] = []

    def scoring(task: str) -> Callable[[], Sequence[Predictor]]:
        factory, records = make(task), iter(groups[task])

        def one() -> list[Predictor]:
            calls = [k for k, _, _ in _calls(next(records))]
            return [_Scoring(p, task, calls, out) for p in factory()]

        return one

    evaluate(groups, scoring)
    return out
