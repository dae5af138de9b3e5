"""The E2B protocol benchmark in its quick mode, so that it cannot rot: every row has both sides and a ratio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(600)
def test_quick_run_reports_both_sides(tmp_path: Path) -> None:
    env = {**os.environ, "BUNSHIN_RUNDIR": str(tmp_path / "ws")}
    res = subprocess.run(
        [sys.executable, str(REPO / "bench" / "e2b_bench.py"), "--quick"],
        capture_output=True, text=True, env=env, timeout=580,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    for row in ("create_to_first_command", "command_round_trip", "file_round_trip", "fork8"):
        assert out[row]["native"]["n"] > 0 and out[row]["e2b_protocol"]["n"] > 0, row
        assert out[row]["ratio"] > 0, row
