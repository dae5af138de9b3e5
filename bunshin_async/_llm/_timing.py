"""Timing models of the replay server: when each token of a replayed turn is sent, relative to the request."""

from __future__ import annotations

import math
import random

import msgspec

__all__ = ["FixedTiming", "LognormalTiming", "RecordedTiming", "TimingModel", "token_offsets"]


class FixedTiming(msgspec.Struct, frozen=True, tag="fixed"):
    """Every turn: first token after ``ttft`` seconds, then one token every ``itl`` seconds."""

    ttft: float = 0.2
    itl: float = 0.01


class LognormalTiming(msgspec.Struct, frozen=True, tag="lognormal"):
    """Per turn, ``ttft`` and ``itl`` are drawn from log-normal distributions with these medians and ``sigma``.
    Draws are seeded by ``seed`` and the turn's identity, so a turn gets the same timing whatever the request
    order."""

    ttft: float = 0.5
    itl: float = 0.02
    sigma: float = 0.5
    seed: int = 0


class RecordedTiming(msgspec.Struct, frozen=True, tag="recorded"):
    """The turn takes the trajectory's recorded ``llm_seconds`` end to end: the first token after
    ``min(ttft, llm_seconds)``, the rest spread evenly so that the last one lands at ``llm_seconds``. Turns without a
    recorded time use ``fallback``."""

    ttft: float = 0.2
    fallback: FixedTiming = FixedTiming()


TimingModel = FixedTiming | LognormalTiming | RecordedTiming


def token_offsets(model: TimingModel, n: int, llm_seconds: float | None, key: str) -> list[float]:
    """Send times (seconds after the request) of ``n`` tokens; ``key`` seeds the random models."""
    n = max(n, 1)
    if isinstance(model, RecordedTiming):
        if llm_seconds is None:
            return token_offsets(model.fallback, n, None, key)
        total = max(llm_seconds, 0.0)
        ttft = min(model.ttft, total)
        if n == 1:
            return [total]
        step = (total - ttft) / (n - 1)
        return [ttft + i * step for i in range(n - 1)] + [total]
    if isinstance(model, LognormalTiming):
        rng = random.Random(f"{model.seed}:{key}")
        ttft = rng.lognormvariate(math.log(model.ttft), model.sigma) if model.ttft > 0 else 0.0
        itl = rng.lognormvariate(math.log(model.itl), model.sigma) if model.itl > 0 else 0.0
        return [ttft + i * itl for i in range(n)]
    return [model.ttft + i * model.itl for i in range(n)]
