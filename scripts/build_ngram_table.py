#!/usr/bin/env python3
"""Rebuild speculator's bundled n-gram table (``speculator/ngram-swebench.json.gz``) from a trace file.

Usage: .venv/bin/python scripts/build_ngram_table.py [TRACES] [OUT]  (defaults: the shared SWE-bench traces beside
the checkout, ../shared/traces, and the package data file).

The table's calibration is measured out of sample: the trajectories are split in two halves (by task); a model
trained on one half predicts the other (each trajectory replayed as its own group, ``speculator._offline``), and
each predictor's stated probabilities are mapped to the hit rates they scored there. The shipped counts are then
trained on every trajectory. Never build it from the traces you measure the product on.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bunshin_async.speculation import Predictor  # noqa: E402
from speculator import NGRAM_TABLE, NgramModel, SiblingTable, default_speculation, train_ngram  # noqa: E402
from speculator._offline import OfflineReport, Record, calibration, evaluate, load_groups  # noqa: E402


def held_out_calibration(groups: Mapping[str, Sequence[Record]]) -> dict[str, list[float]]:
    """Per predictor, its hit rate per tenth of stated probability, measured out of sample: ``groups`` are split in
    two halves (by name); a model trained on one half predicts the other, and the other way round."""
    names = sorted(groups)
    halves = [{n: groups[n] for n in names[k::2]} for k in (0, 1)]
    merged: dict[str, list[tuple[float, int, int]]] = {}
    report = OfflineReport()
    for train, test in ((halves[0], halves[1]), (halves[1], halves[0])):
        model = NgramModel(3)
        for records in train.values():
            for r in records:
                model.add_record(r)

        def make(task: str, model: NgramModel = model) -> Callable[[], Sequence[Predictor]]:
            table, own = SiblingTable(), copy.deepcopy(model)  # the history predictor learns into its model
            return lambda: list(default_speculation(group=task, table=table, model=own).predictors)

        report = evaluate(test, make)
        for source, bins in report.calibration.items():
            acc = {lo: [n, h] for lo, n, h in merged.get(source, [])}
            for lo, n, h in bins:
                a = acc.setdefault(lo, [0, 0])
                a[0] += n
                a[1] += h
            merged[source] = [(lo, n, h) for lo, (n, h) in sorted(acc.items())]
    report.calibration = merged
    return calibration(report)


def main() -> int:
    default = next(
        (p for p in (d / "shared/traces/swebench-gemini-3-pro.jsonl.gz" for d in ROOT.parents) if p.exists()), None
    )
    traces = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    if traces is None:
        print("no trace file given and none found in a shared/traces beside the checkout", file=sys.stderr)
        return 2
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "speculator" / NGRAM_TABLE
    model = train_ngram(traces)
    rates = held_out_calibration(load_groups(traces, group_by="rollout"))
    model.calibration = {k: v for k, v in rates.items() if k in ("history", "signatures")}
    data = model.to_table()
    out.write_bytes(data)
    print(f"{out}: {len(data)} bytes, {len(model.counts)} contexts trained from {traces}")
    for source, table in model.calibration.items():
        print(f"  calibration of {source} (hit rate per tenth of stated probability): {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
