"""A predictor that is another one with its guesses changed one by one (``Wrapped``)."""

from __future__ import annotations

from collections.abc import Sequence

from bunshin_async.speculation import CallKey, Candidate, PredictionContext, Predictor

__all__ = ["Wrapped"]


class Wrapped:
    """``inner``, each of its guesses passed through ``candidate`` (which keeps it as it is unless overridden).
    Named as ``inner`` and told what it is told: it *is* that predictor (ablations leave it out by name, and a
    wrapped predictor still learns online)."""

    def __init__(self, inner: Predictor) -> None:
        self.inner = inner
        self.name = inner.name

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        return [self.candidate(ctx, c) for c in self.inner.predict(ctx)]

    def candidate(self, ctx: PredictionContext, c: Candidate) -> Candidate:
        return c

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.inner.observe(ctx, call)
