"""The verl integration's tests (``verl_suite.py``) run in verl's own environment, ``.venv-verl`` (verl pulls torch,
which the main venv stays without; ``scripts/setup.sh`` builds it). This runs them there, with this run's
directories, and fails with their output if they fail."""

from __future__ import annotations

import pytest

from tests.integrations.conftest import ROOT, run_suite

VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"


@pytest.mark.slow
async def test_verl_suite_in_its_environment() -> None:
    await run_suite(VERL_PYTHON, "verl_suite.py", made_by="scripts/verl-env.sh", skips_ok=True)
