"""The E2B protocol benchmark in its quick mode, so that it cannot rot: every row has both sides and a ratio."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._quick import quick_run


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(600)
def test_quick_run_reports_both_sides(tmp_path: Path) -> None:
    out = quick_run("e2b_bench.py", tmp_path, timeout=580)
    for row in ("create_to_first_command", "command_round_trip", "file_round_trip", "fork8"):
        assert out[row]["native"]["n"] > 0 and out[row]["e2b_protocol"]["n"] > 0, row
        assert out[row]["ratio"] > 0, row
