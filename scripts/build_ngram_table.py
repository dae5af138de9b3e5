#!/usr/bin/env python3
"""Rebuild speculator's bundled n-gram table (``speculator/ngram-swebench.json.gz``) from a trace file.

Usage: .venv/bin/python scripts/build_ngram_table.py [TRACES] [OUT]  (defaults: the shared SWE-bench traces beside
the checkout, ../shared/traces, and the package data file).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from speculator import NGRAM_TABLE, train_ngram  # noqa: E402


def main() -> int:
    traces = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT.parent / "shared/traces/swebench-gemini-3-pro.jsonl.gz"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "speculator" / NGRAM_TABLE
    model = train_ngram(traces)
    data = model.to_table()
    out.write_bytes(data)
    print(f"{out}: {len(data)} bytes, {len(model.counts)} contexts trained from {traces}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
