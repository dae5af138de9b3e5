"""The Harbor integration through Harbor's own ``Trial`` and ``harbor run`` with the ``oracle`` agent, on a local
Terminal-Bench-style task (an imported image, a solution script, a verifier test). Runs in Harbor's environment
(``.venv-harbor``, Python >= 3.12, made by ``scripts/setup.sh`` where the set-up's Python is 3.12 or later: the
clean-root check's Debian 13 root in CI): ``tests/integrations/test_harnesses.py`` runs this file there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harbor.models.trial.config import AgentConfig as TrialAgentConfig
from harbor.models.trial.config import EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial

from bunshin_async.integrations.harbor import BunshinEnvironment
from tests.test_exported_members import check_public_module

ROOT = Path(__file__).resolve().parents[2]
IMPORT_PATH = "bunshin_async.integrations.harbor:BunshinEnvironment"
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network here: litellm's bundled map
# Harbor's Trial reads its own soon-deprecated Task.checksum
pytestmark = pytest.mark.filterwarnings("ignore:Task.checksum will be deprecated:DeprecationWarning")


def make_task(root: Path, *, solved: bool = True, network: str = "no-network") -> Path:
    """A task on Bunshin's Debian base image: write a file under /app; the verifier checks it and its upload."""
    task = root / "hello-file"
    for d in ("environment", "solution", "tests"):
        (task / d).mkdir(parents=True)
    (task / "task.toml").write_text(
        'version = "1.0"\n[verifier]\ntimeout_sec = 120.0\n[agent]\ntimeout_sec = 120.0\n'
        f'[environment]\ndocker_image = "debian-bookworm"\nnetwork_mode = "{network}"\n'
    )
    (task / "instruction.md").write_text("Write the word hello to /app/out.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm\n")
    answer = "hello" if solved else "goodbye"
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\nmkdir -p /app && echo {answer} > /app/out.txt\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\n"
        'if [ "$(cat /app/out.txt)" = hello ] && [ -x /tests/test.sh ]; then r=1; else r=0; fi\n'
        "echo $r > /logs/verifier/reward.txt\n"
    )
    for script in ("solution/solve.sh", "tests/test.sh"):
        (task / script).chmod(0o755)
    return task


def test_public_module() -> None:
    import bunshin_async.integrations.harbor as mod

    check_public_module(mod)


async def run_trial(task: Path, trials: Path) -> object:
    config = TrialConfig(
        task=TaskConfig(path=task),
        trials_dir=trials,
        agent=TrialAgentConfig(name="oracle"),
        environment=EnvironmentConfig(import_path=IMPORT_PATH),
    )
    trial = await Trial.create(config)
    return await trial.run()


@pytest.mark.slow
async def test_trial_with_the_oracle_gets_reward_one(tmp_path: Path) -> None:
    result = await run_trial(make_task(tmp_path), tmp_path / "trials")
    assert result.exception_info is None, result.exception_info  # type: ignore[attr-defined]
    assert result.verifier_result.rewards == {"reward": 1.0}  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_an_unsolved_task_gets_reward_zero(tmp_path: Path) -> None:
    """The reward comes from the verifier in the workspace, not from a constant."""
    result = await run_trial(make_task(tmp_path, solved=False), tmp_path / "trials")
    assert result.verifier_result.rewards == {"reward": 0.0}  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_a_task_asking_for_the_internet_is_rejected(tmp_path: Path) -> None:
    """A workspace has loopback only: the capability is declared truthfully and a public-network task refused."""
    with pytest.raises(ValueError, match="no network but loopback"):
        await run_trial(make_task(tmp_path, network="public"), tmp_path / "trials")


def test_capabilities_are_truthful() -> None:
    caps = BunshinEnvironment.capabilities.fget(None)  # type: ignore[attr-defined]
    assert caps.disable_internet and not caps.gpus and not caps.mounted and not caps.docker_compose


@pytest.mark.slow
def test_harbor_run_cli_with_the_oracle(tmp_path: Path) -> None:
    task = make_task(tmp_path)
    jobs = tmp_path / "jobs"
    r = subprocess.run(
        [str(Path(sys.executable).with_name("harbor")), "run", "-p", str(task), "--env", IMPORT_PATH, "-a", "oracle",
         "-o", str(jobs), "-y"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [reward] = jobs.glob("*/*/verifier/reward.txt")
    assert reward.read_text().strip() == "1"
    [result] = jobs.glob("*/result.json")
    assert json.loads(result.read_text())["stats"]["n_errored_trials"] == 0
