"""Runs a benchmark script in its quick mode, so that a test can check its JSON has every row (it cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def quick_run(script: str, tmp_path: Path, timeout: float) -> dict[str, Any]:
    """``bench/<script> --quick`` with its workspaces under ``tmp_path``; its printed JSON."""
    env = {**os.environ, "BUNSHIN_RUNDIR": str(tmp_path / "ws")}
    res = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--quick"],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, Any] = json.loads(res.stdout)
    return out
