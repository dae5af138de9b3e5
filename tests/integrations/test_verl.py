"""The verl integration's tests (``verl_suite.py``) run in verl's own environment, ``.venv-verl`` (verl pulls torch,
which the main venv stays without; ``scripts/setup.sh`` builds it). This runs them there, with this run's
directories, and fails with their output if they fail."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"


@pytest.mark.slow
async def test_verl_suite_in_its_environment() -> None:
    assert VERL_PYTHON.exists(), f"{VERL_PYTHON} is missing: run `make setup` (scripts/verl-env.sh)"
    argv = [
        str(VERL_PYTHON),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(Path(__file__).with_name("verl_suite.py")),
    ]
    # The suite's own conftest gives it its own rundir, snapshot dir and cgroup parent, as this run has.
    mine = ("BUNSHIN_RUNDIR", "BUNSHIN_SNAPDIR", "BUNSHIN_CGROUP_PARENT")
    env = {k: v for k, v in os.environ.items() if k not in mine}
    proc = await anyio.run_process(argv, cwd=ROOT, env=env, check=False)
    out = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, out[-8000:]
    assert " passed" in out.splitlines()[-1] and "failed" not in out.splitlines()[-1], out[-2000:]
    sys.stdout.write(out.splitlines()[-1] + "\n")
