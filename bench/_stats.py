"""Shared helpers for the benchmarks: summary statistics and PSS."""

from __future__ import annotations

import statistics
from collections.abc import Iterable


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
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total
