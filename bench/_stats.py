"""Shared helpers for the benchmarks: summary statistics and PSS."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from bunshin_async._workspace._accounting import pss_bytes


def summary(samples: list[float], scale: float = 1000.0) -> dict[str, float]:
    """Median, p90, min and max of ``samples`` (seconds), in milliseconds by default."""
    xs = sorted(samples)
    p90 = xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]
    return {
        "n": len(xs),
        "median": round(statistics.median(xs) * scale, 3),
        "p90": round(p90 * scale, 3),
        "min": round(xs[0] * scale, 3),
        "max": round(xs[-1] * scale, 3),
    }


def pss_kib(pids: Iterable[int]) -> int:
    """Total proportional set size of ``pids`` in KiB (shared pages divided among their sharers)."""
    return pss_bytes(pids) // 1024
