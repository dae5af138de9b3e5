"""The agent-harness integrations run in environments of their own (the main venv's pins do not admit the
frameworks; ``scripts/harness-env.sh`` builds them): inspect-ai and mini-swe-agent in ``.venv-harness``, Harbor
(Python >= 3.12) in ``.venv-harbor``. Each test runs one suite there with this run's directories."""

from __future__ import annotations

import pytest

from tests.integrations.conftest import ROOT, run_suite

HARNESS_PYTHON = ROOT / ".venv-harness" / "bin" / "python"
HARBOR_PYTHON = ROOT / ".venv-harbor" / "bin" / "python"


@pytest.mark.slow
async def test_mini_swe_agent_suite() -> None:
    await run_suite(HARNESS_PYTHON, "mini_swe_agent_suite.py", made_by="scripts/harness-env.sh")


@pytest.mark.slow
async def test_inspect_suite() -> None:
    # inspect's in-process eval leaves anyio memory streams of its own unclosed until exit (not a workspace's)
    await run_suite(
        HARNESS_PYTHON,
        "inspect_suite.py",
        made_by="scripts/harness-env.sh",
        pytest_args=("-W", "ignore::ResourceWarning"),
    )
