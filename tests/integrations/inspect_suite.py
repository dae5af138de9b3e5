"""The inspect-ai integration: inspect's own provider conformance suite (``self_check``, pulled into this module's
collection) against the ``bunshin`` provider, and ``inspect eval`` of a small task with ``sandbox="bunshin"`` and
inspect's mock model. Runs in the harness environment (``.venv-harness``, made by ``scripts/setup.sh``):
``tests/integrations/test_harnesses.py`` runs this file there."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import Generate, TaskState, solver
from inspect_ai.util import sandbox
from inspect_ai.util._sandbox.self_check import *  # noqa: F403 - inspect's checks, collected here
from inspect_ai.util._sandbox.self_check import __all__ as SELF_CHECKS

from bunshin_async.integrations.inspect import BunshinSandboxConfig, BunshinSandboxEnvironment
from tests.test_exported_members import check_public_module

HERE = Path(__file__).parent
# inspect's model retry passes tenacity a deprecated argument; nothing here retries
pytestmark = pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning")

# Checks the provider fails on purpose, with the reason (docs/integrations/harnesses.md lists them).
EXPECTED_FAILURES = {
    "test_read_file_not_allowed": "file operations act as root, whom a missing read bit does not stop",
    "test_write_text_file_without_permissions": "file operations act as root, whom a missing write bit does not stop",
    "test_write_binary_file_without_permissions": "file operations act as root, whom a missing write bit does not stop",
}


@pytest.fixture
async def sandbox_env(request: pytest.FixtureRequest) -> AsyncIterator[BunshinSandboxEnvironment]:
    """One workspace per check (``sample_init`` .. ``sample_cleanup``, as inspect runs a sample)."""
    reason = EXPECTED_FAILURES.get(request.node.originalname)
    if reason:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
    envs = await BunshinSandboxEnvironment.sample_init("self_check", None, {})
    try:
        env = envs["default"]
        assert isinstance(env, BunshinSandboxEnvironment)
        yield env
    finally:
        await BunshinSandboxEnvironment.sample_cleanup("self_check", None, envs, False)
        assert env.workspace.closed


def test_public_module() -> None:
    import bunshin_async.integrations.inspect as mod

    check_public_module(mod)


def test_every_self_check_is_collected() -> None:
    assert len(SELF_CHECKS) == 44 and set(EXPECTED_FAILURES) <= set(SELF_CHECKS)


async def test_connection_names_the_workspace(sandbox_env: BunshinSandboxEnvironment) -> None:
    conn = await sandbox_env.connection()
    assert conn.type == "bunshin" and conn.container == sandbox_env.workspace.id
    proc = await anyio.run_process(["/bin/sh", "-c", conn.command], input=b"cat /proc/1/comm; pwd\n", check=False)
    assert proc.stdout.decode().split() == ["bunshin-init", sandbox_env.workspace.workdir], proc.stderr


async def test_file_operations_outside_the_working_directory_leave_no_stage(
    sandbox_env: BunshinSandboxEnvironment,
) -> None:
    await sandbox_env.write_file("/opt/deep/dir/f.bin", b"\x00\xffdata")
    assert await sandbox_env.read_file("/opt/deep/dir/f.bin", text=False) == b"\x00\xffdata"
    # a symlink in the workspace is the workspace's business: followed inside it, never on the host
    await sandbox_env.exec(["ln", "-s", "/etc/hostname", "/opt/link"])
    assert (await sandbox_env.read_file("/opt/link")).strip() == "bunshin"
    listing = await sandbox_env.exec(["ls", "-A", sandbox_env.workspace.workdir])
    assert ".bunshin-inspect-" not in listing.stdout


@solver
def make_answer():  # type: ignore[no-untyped-def]
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        await sandbox().exec(["sh", "-c", f"echo {state.input_text} | tr a-z A-Z > answer.txt"])
        return state

    return solve


@scorer(metrics=[accuracy()])
def answer_in_sandbox():  # type: ignore[no-untyped-def]
    async def score(state: TaskState, target: Target) -> Score:
        got = (await sandbox().read_file("answer.txt")).strip()
        return Score(value=CORRECT if got == target.text else INCORRECT, answer=got)

    return score


@pytest.mark.slow
def test_eval_with_the_mock_model_scores(tmp_path: Path) -> None:
    """In process: two samples, two epochs, each in a workspace of its own; all closed afterwards."""
    task = Task(
        dataset=[Sample(input="hello", target="HELLO"), Sample(input="bunshin", target="BUNSHIN")],
        solver=make_answer(),
        scorer=answer_in_sandbox(),
        sandbox=("bunshin", BunshinSandboxConfig(env={"LC_ALL": "C"})),
        epochs=2,
    )
    [log] = eval(task, model="mockllm/model", log_dir=str(tmp_path), display="none")
    assert log.status == "success", log.error
    assert log.results is not None
    assert log.results.scores[0].metrics["accuracy"].value == 1.0
    assert log.samples is not None and len(log.samples) == 4
    assert not BunshinSandboxEnvironment._live


@pytest.mark.slow
def test_inspect_eval_cli_finds_the_provider_by_entry_point(tmp_path: Path) -> None:
    """``inspect eval`` from the command line; the task file does not import Bunshin: the entry point must."""
    r = subprocess.run(
        [sys.executable, "-m", "inspect_ai", "eval", "inspect_task.py", "--model", "mockllm/model",
         "--log-dir", str(tmp_path), "--log-format", "json", "--display", "plain"],
        cwd=HERE, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [log_file] = tmp_path.glob("*.json")
    log = json.loads(log_file.read_text())
    assert log["status"] == "success"
    assert log["results"]["scores"][0]["metrics"]["accuracy"]["value"] == 1.0
