"""How long calls of a kind take, learned from timed traces: a guess's ``expected_seconds`` where its predictor has
none, so that a policy that has not yet seen a call of that kind in its run does not take an install for a 0.3 s
call (``CostAwarePolicy`` weighs a launch by ``min(expected run time, LLM time left)``: a run time it does not
know is its ``default_seconds``, and a long call it underrates is refused as if it could hide nothing)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from bunshin_async.speculation import Candidate, PredictionContext, Predictor

from ._signature import signature
from ._wrapped import Wrapped

__all__ = ["RunTimes", "TimedPredictor"]


class _Table(msgspec.Struct, frozen=True):
    seconds: dict[str, float]
    counts: dict[str, int]


class RunTimes:
    """Per call signature (``tool:program``), the mean run time of the calls seen with it (``add``, ``add_record``
    for a trace record's timed steps); ``seconds`` answers only for signatures seen at least ``min_count``
    times. The mean, not the median: run times of one signature are heavy-tailed (``python script`` runs a
    check or a training), and a policy that caps the gain at the LLM time left loses little by a long estimate
    of a short call but refuses every long call a short estimate underrates."""

    def __init__(self, min_count: int = 3) -> None:
        self.min_count = min_count
        self._sum: dict[str, float] = {}
        self._n: dict[str, int] = {}

    def add(self, name: str, args: Mapping[str, Any], seconds: float) -> None:
        if seconds >= 0:
            sig = signature(name, args)
            self._sum[sig] = self._sum.get(sig, 0.0) + seconds
            self._n[sig] = self._n.get(sig, 0) + 1

    def add_record(self, record: Mapping[str, Any]) -> None:
        """The timed tool steps of a trace record (``/work/shared/traces`` format; untimed steps are skipped)."""
        for step in record.get("steps", ()):
            seconds = step.get("tool_seconds")
            if step.get("tool") and step.get("kind") != "format_error" and isinstance(seconds, (int, float)):
                self.add(step["tool"], step.get("args") or {}, float(seconds))

    def seconds(self, name: str, args: Mapping[str, Any]) -> float | None:
        sig = signature(name, args)
        n = self._n.get(sig, 0)
        return self._sum[sig] / n if n >= self.min_count else None

    def to_table(self) -> bytes:
        """The signatures seen at least ``min_count`` times, their mean seconds and counts (JSON)."""
        keep = sorted(s for s, n in self._n.items() if n >= self.min_count)
        table = _Table({s: round(self._sum[s] / self._n[s], 3) for s in keep}, {s: self._n[s] for s in keep})
        return msgspec.json.encode(table)

    @classmethod
    def from_table(cls, data: bytes) -> RunTimes:
        table = msgspec.json.decode(data, type=_Table)
        out = cls(min_count=1)
        for sig, mean in table.seconds.items():
            n = max(1, table.counts.get(sig, 1))
            out._sum[sig], out._n[sig] = mean * n, n
        return out

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]], min_count: int = 3) -> RunTimes:
        out = cls(min_count)
        for record in records:
            out.add_record(record)
        return out


class TimedPredictor(Wrapped):
    """``inner``'s guesses, each stating the run time ``times`` expects of its signature where ``inner`` stated
    none (and ``times`` knows one)."""

    def __init__(self, inner: Predictor, times: RunTimes) -> None:
        super().__init__(inner)
        self.times = times

    def candidate(self, ctx: PredictionContext, c: Candidate) -> Candidate:
        seconds = self.times.seconds(c.name, c.arguments) if c.expected_seconds is None else None
        return c if seconds is None else msgspec.structs.replace(c, expected_seconds=seconds)
