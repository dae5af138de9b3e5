"""The agent-harness integrations run in environments of their own (the main venv's pins do not admit the
frameworks; ``scripts/harness-env.sh`` builds them): inspect-ai and mini-swe-agent in ``.venv-harness``, Harbor
(Python >= 3.12) in ``.venv-harbor``. Each test runs one suite there with this run's directories."""

from __future__ import annotations

import subprocess

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


def _setup_python_has_312() -> bool:
    """Whether the set-up's Python (``python3``, what scripts/harness-env.sh builds with) is 3.12 or later."""
    r = subprocess.run(["python3", "-c", "import sys; sys.exit(sys.version_info < (3, 12))"], check=False)
    return r.returncode == 0


@pytest.mark.slow
async def test_harbor_suite() -> None:
    """Harbor needs Python >= 3.12. On a host whose set-up Python is older (Debian 12's 3.11) there is no
    ``.venv-harbor``; CI runs this test in the clean-root check's Debian 13 root (Makefile ``fresh-check``)."""
    if not HARBOR_PYTHON.exists() and not _setup_python_has_312():
        pytest.skip(
            "Harbor needs Python >= 3.12: this runs in the clean-root check's Debian 13 root (make fresh-check)"
        )
    await run_suite(HARBOR_PYTHON, "harbor_suite.py", made_by="scripts/harness-env.sh")
