"""The mini-swe-agent integration through mini's own ``DefaultAgent``, its deterministic test model and its
environment loader (``get_environment``). Runs in the harness environment (``.venv-harness``, made by
``scripts/setup.sh``): ``tests/integrations/test_harnesses.py`` runs this file there."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

import pytest
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

from bunshin_async import UsageError
from bunshin_async.integrations._portal import PortalRuntime
from bunshin_async.integrations.mini_swe_agent import BunshinEnvironment, default_runtime
from tests.images import _build
from tests.test_exported_members import check_public_module

CLASS_PATH = "bunshin_async.integrations.mini_swe_agent.BunshinEnvironment"


@pytest.fixture
def runtime() -> Iterator[PortalRuntime]:
    rt = PortalRuntime()
    try:
        yield rt
    finally:
        rt.close_all()


def test_public_module() -> None:
    import bunshin_async.integrations.mini_swe_agent as mod

    check_public_module(mod)


@pytest.mark.slow
def test_default_agent_runs_a_task_to_submission(runtime: PortalRuntime) -> None:
    env = BunshinEnvironment(runtime=runtime, timeout=30)
    model = DeterministicModel(
        outputs=[
            make_output("write it", [{"command": "printf 'def add(a, b):\\n    return a + b\\n' > add.py"}]),
            make_output("check it", [{"command": "python3 -c 'import add; assert add.add(2, 3) == 5' && echo ok"}]),
            make_output("a failing probe", [{"command": "ls /nonexistent; echo after"}]),
            make_output("submit", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat add.py"}]),
        ]
    )
    agent = DefaultAgent(
        model, env, system_template="You are a bot.", instance_template="{{task}}", step_limit=10, cost_limit=0
    )
    result = agent.run("write add.py")
    assert result == {"exit_status": "Submitted", "submission": "def add(a, b):\n    return a + b\n"}
    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
    assert "<returncode>0</returncode>" in observations[1] and "ok" in observations[1]
    # stderr is merged into the output, in order, as in mini's own environments
    assert "No such file or directory" in observations[2] and observations[2].index("ls:") < observations[2].index(
        "after"
    )
    assert env.workspace is not None
    assert runtime.call(lambda: env.workspace.read_file("add.py")) == b"def add(a, b):\n    return a + b\n"  # type: ignore[union-attr]
    data = agent.serialize()
    assert data["info"]["config"]["environment_type"] == CLASS_PATH
    env.cleanup()
    env.cleanup()  # idempotent
    assert runtime.live == 0


@pytest.mark.slow
def test_execute_contract() -> None:
    """Made as mini makes environments from a config (on the default runtime: a config is deep-copied)."""
    env = get_environment({"environment_class": CLASS_PATH, "timeout": 5, "env": {"GREETING": "hi"}})
    assert isinstance(env, BunshinEnvironment)
    try:
        out = env.execute({"command": "echo $GREETING; echo oops >&2; exit 3"})
        assert out == {"output": "hi\noops\n", "returncode": 3, "exception_info": ""}
        assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
        # a timeout is an observation, not a crash, and the command is killed
        slow = env.execute({"command": "echo started; sleep 30 # mswea-marker"}, timeout=1)
        assert slow["returncode"] == -1 and "timed out" in slow["exception_info"]
        assert slow["extra"]["exception_type"] == "ToolTimeout"
        left = env.execute({"command": "ps -eo args | grep -c '[m]swea-marker' || true"})
        assert left["output"].strip() == "0"
        # the marker must be the first line and the command must succeed
        assert env.execute({"command": "echo x; echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})["returncode"] == 0
        assert env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; false"})["returncode"] == 1
        with pytest.raises(Submitted) as info:
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo done"})
        assert info.value.messages[0]["extra"]["submission"] == "done\n"
        tv = env.get_template_vars(extra_var=1)
        assert tv["timeout"] == 5 and tv["extra_var"] == 1 and tv["workspace_id"] == env.workspace.id  # type: ignore[union-attr]
    finally:
        env.cleanup()
    assert default_runtime().live == 0
    with pytest.raises(UsageError, match="closed"):  # used after cleanup: the caller's bug, a BunshinError
        env.execute({"command": "true"})


@pytest.mark.slow
def test_image_from_the_docker_engine(runtime: PortalRuntime) -> None:
    """A Docker reference (not in Bunshin's layer store) is imported from the local engine."""
    tag = _build.build("mini-task", _build.bookworm())
    with BunshinEnvironment(runtime=runtime, image=tag) as env:
        assert env.execute({"command": "cat /task/README"})["output"] == "fix the bug\n"
    assert runtime.live == 0
