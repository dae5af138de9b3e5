"""An n-gram model over call signatures (``NgramModel``, trainable from traces, saved as a table) and the
predictors built on it: ``HistoryPredictor`` and ``SignaturePredictor``."""

from __future__ import annotations

import gzip
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from bunshin_async import InvalidValue
from bunshin_async.speculation import CallKey, Candidate, PredictionContext

from ._siblings import SiblingTable
from ._signature import key_signature, signature

__all__ = [
    "HistoryPredictor",
    "NgramModel",
    "SignaturePredictor",
]


class NgramModel:
    """An n-gram model over call signatures (``tool:program``) with back-off, plus, per signature, how often the
    next call with that signature repeats the rollout's latest one exactly (re-running a test after an edit)."""

    def __init__(self, order: int = 3) -> None:
        self.order = order
        self.counts: dict[tuple[str, ...], Counter[str]] = defaultdict(Counter)
        self.repeat: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()
        #: Observed hit rate per decile of a predictor's stated probability (``calibrate``): index ``int(10 p)``.
        self.calibration: dict[str, list[float]] = {}

    def calibrated(self, source: str, probability: float) -> float:
        """``probability`` as ``source``'s guesses with that stated probability turned out, where measured
        (``calibrate``); unchanged otherwise."""
        table = self.calibration.get(source)
        if not table:
            return probability
        return table[min(len(table) - 1, int(probability * len(table)))]

    def add_sequence(self, calls: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
        sigs: list[str] = []
        latest: dict[str, bytes] = {}
        for name, args in calls:
            sig = signature(name, args)
            for n in range(self.order):
                if n <= len(sigs):
                    ctx = tuple(sigs[len(sigs) - n :]) if n else ()
                    self.counts[ctx][sig] += 1
            exact = msgspec.json.encode(args, order="deterministic")
            if sig in latest:
                self.seen[sig] += 1
                self.repeat[sig] += latest[sig] == exact
            latest[sig] = exact
            sigs.append(sig)

    def next_signatures(self, history: Sequence[str], top: int = 5) -> list[tuple[str, float]]:
        """P(next signature | the last ``order-1`` signatures), backing off to shorter contexts."""
        for n in range(min(self.order - 1, len(history)), -1, -1):
            ctx = tuple(history[len(history) - n :]) if n else ()
            counter = self.counts.get(ctx)
            if counter:
                total = sum(counter.values())
                return [(s, c / total) for s, c in counter.most_common(top)]
        return []

    def repeat_probability(self, sig: str) -> float:
        return (self.repeat[sig] + 0.5) / (self.seen[sig] + 2.0)

    def to_table(self, *, min_count: int = 2, top: int = 12) -> bytes:
        """A compact table of what the model learned (gzipped JSON): per context, its ``top`` next signatures seen
        at least ``min_count`` times, and the repeat statistics. ``from_table`` reads it back."""
        table = _NgramTable(
            order=self.order,
            contexts=[
                (list(ctx), {s: c for s, c in counter.most_common(top) if c >= min_count})
                for ctx, counter in sorted(self.counts.items())
                if sum(counter.values()) >= min_count and counter.most_common(1)[0][1] >= min_count
            ],
            repeat=dict(self.repeat),
            seen={s: n for s, n in self.seen.items() if n >= min_count},
            calibration=self.calibration,
        )
        return gzip.compress(_table_encoder.encode(table), mtime=0)

    @classmethod
    def from_table(cls, data: bytes) -> NgramModel:
        """The model ``to_table`` wrote. Raises ``ValueError`` on anything else."""
        try:
            table = _table_decoder.decode(gzip.decompress(data))
        except (OSError, EOFError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidValue(f"not an n-gram table: {exc}", argument="path") from None
        model = cls(table.order)
        for ctx, nexts in table.contexts:
            model.counts[tuple(ctx)].update(nexts)
        model.repeat.update({s: n for s, n in table.repeat.items() if s in table.seen})
        model.seen.update(table.seen)
        model.calibration = {k: list(v) for k, v in table.calibration.items()}
        return model

    def add_record(self, record: Mapping[str, Any]) -> None:
        """Learn one trajectory record (``/work/shared/traces`` format): its tool calls, format errors and the final
        submission left out."""
        self.add_sequence(
            (s["tool"], s.get("args") or {})
            for s in record.get("steps", ())
            if s.get("tool") and s.get("kind") != "format_error" and s.get("tool") != "submit"
        )

    def train_file(self, path: str | os.PathLike[str], limit: int | None = None) -> int:
        """Train on a JSONL(.gz) trace file (``/work/shared/traces`` format or ``Trajectory`` records). Blocking;
        returns the number of trajectories read."""
        opener: Callable[..., Any] = gzip.open if str(path).endswith(".gz") else open
        n = 0
        with opener(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                self.add_record(msgspec.json.decode(line))
                n += 1
                if limit is not None and n >= limit:
                    break
        return n


class _NgramTable(msgspec.Struct):
    order: int
    contexts: list[tuple[list[str], dict[str, int]]]
    repeat: dict[str, int]
    seen: dict[str, int]
    calibration: dict[str, list[float]] = msgspec.field(default_factory=dict)


_table_encoder = msgspec.json.Encoder(order="deterministic")
_table_decoder = msgspec.json.Decoder(_NgramTable)


class HistoryPredictor:
    """Predicts from an ``NgramModel``: the likely next signatures, each made concrete as the rollout's latest call
    with that signature (probability: P(signature) x P(exact repeat)). Learns online from observed calls."""

    name = "history"

    def __init__(self, model: NgramModel | None = None, *, top: int = 3, learn: bool = True) -> None:
        self.model = model if model is not None else NgramModel()
        self.top = top
        self.learn = learn

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        calls = [*ctx.history]
        sigs = [key_signature(c) for c in calls]
        latest: dict[str, CallKey] = {}
        for sig, call in zip(sigs, calls, strict=True):
            latest[sig] = call
        out: list[Candidate] = []
        for sig, p in self.model.next_signatures(sigs, top=8):
            prev = latest.get(sig)
            if prev is None:
                continue
            prob = self.model.calibrated(self.name, p * self.model.repeat_probability(sig))
            out.append(Candidate(name=prev.name, arguments=prev.arguments(), probability=prob, source=self.name))
            if len(out) >= self.top:
                break
        return out

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        if not self.learn:
            return
        sig = key_signature(call)
        history = [key_signature(c) for c in ctx.history[len(ctx.history) - (self.model.order - 1) :]]
        for n in range(self.model.order):
            if n <= len(history):
                key = tuple(history[len(history) - n :]) if n else ()
                self.model.counts[key][sig] += 1


class SignaturePredictor:
    """Calls that recur by program signature, across tasks: an ``NgramModel`` (learned from trajectory corpora)
    says which signatures come next (after an edit, the test run; after a failed import, an install), and the group
    says which concrete call each one is: the rollout's own latest call with that signature (probability: P(next
    signature) x P(it repeats exactly)), else the calls siblings made with it (P(next signature) x P(not a repeat)
    x their share of the group's calls with that signature). Probabilities go through the model's calibration for
    this source (``NgramModel.calibrate``: what such guesses scored on held-out traces). Where the same call is
    both, it keeps the larger."""

    name = "signatures"

    def __init__(self, model: NgramModel, table: SiblingTable | None = None, *, top: int = 3) -> None:
        self.model = model
        self.table = table if table is not None else SiblingTable()
        self.top = top

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        history = [*ctx.history, *ctx.decided[: ctx.position]]
        sigs = [key_signature(c) for c in history]
        latest: dict[str, CallKey] = {}
        for sig, call in zip(sigs, history, strict=True):
            latest[sig] = call
        scored: dict[CallKey, float] = {}
        for sig, p in self.model.next_signatures(sigs, top=8):
            repeat = self.model.repeat_probability(sig)
            own = latest.get(sig)
            if own is not None:
                scored[own] = max(scored.get(own, 0.0), p * repeat)
            group = self.table.by_signature.get(sig)
            if group:
                fresh = 1.0 - repeat if own is not None else 1.0
                total = sum(group.values())
                for call, n in group.most_common(self.top):
                    scored[call] = max(scored.get(call, 0.0), p * fresh * n / total)
        best = sorted(scored.items(), key=lambda x: -x[1])[: self.top]
        return [
            Candidate(
                name=k.name,
                arguments=k.arguments(),
                probability=self.model.calibrated(self.name, p),
                source=self.name,
            )
            for k, p in best
        ]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.table.by_signature[key_signature(call)][call] += 1
