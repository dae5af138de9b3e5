"""The agent loop in a real Workspace against the replay server, through the openai SDK."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from bunshin_async import ToolCallError, Workspace
from bunshin_async.agent import Tool, ToolResult, bash_tool, run_agent
from bunshin_async.llm import (
    FixedTiming,
    RecordedTiming,
    Step,
    Trajectory,
    dump_trajectories,
    load_trajectories,
    replay_server,
)

from .conftest import traj

pytestmark = pytest.mark.root

SCRIPT = traj(
    "hello",
    Step("bash", {"command": "ls"}, llm_seconds=0.1, assistant_text="Let me look around."),
    Step("bash", {"command": "echo hi > f.txt"}, llm_seconds=0.1),
    Step("bash", {"command": "cat f.txt"}, llm_seconds=0.1),
    Step(None, llm_seconds=0.1, assistant_text="f.txt contains hi."),
)


async def _run(url: str, make_client: Any, model: str = "replay:hello:0", **kw: Any) -> tuple[Trajectory, bytes]:
    async with Workspace() as ws:
        with anyio.fail_after(30):
            result = await run_agent(make_client(url), model, "Write hi to f.txt", ws, task_id="hello", **kw)
        return result, await ws.read_file("f.txt") if result.steps[1:] else b""


async def test_agent_records_the_expected_trajectory(make_client: Any, tmp_path: Path) -> None:
    async with replay_server([SCRIPT], timing=RecordedTiming()) as url:
        result, content = await _run(url, make_client)
    assert content == b"hi\n"
    assert result.stop_reason == "stop" and result.model == "replay:hello:0"
    assert [(s.tool, s.args) for s in result.steps] == [(s.tool, s.args) for s in SCRIPT.steps]
    assert [s.observation for s in result.steps] == ["exit code 0\n", "exit code 0\n", "exit code 0\nhi\n", None]
    assert [s.exit_code for s in result.steps] == [0, 0, 0, None]
    assert result.steps[0].assistant_text == "Let me look around."
    assert result.steps[-1].assistant_text == "f.txt contains hi."
    assert [s.turn for s in result.steps] == [0, 1, 2, 3]
    for step in result.steps:
        assert step.llm_seconds is not None and 0.09 <= step.llm_seconds <= 0.3
    assert all(s.tool_seconds is not None and s.tool_seconds < 5 for s in result.steps[:3])
    assert [m["role"] for m in result.messages or []] == ["system", "user"] + ["assistant", "tool"] * 3 + ["assistant"]
    # JSONL export round-trips and replays: the recorded run, served with exact matching (observations included),
    # drives a second run in a fresh workspace to the same trajectory.
    path = dump_trajectories(tmp_path / "out.jsonl.gz", [result])
    [loaded] = load_trajectories(path)
    assert loaded == result
    async with replay_server(path, match="exact", timing=FixedTiming(0.0, 0.0)) as url:
        again, content = await _run(url, make_client)
    assert content == b"hi\n"
    assert [(s.tool, s.args, s.observation) for s in again.steps] == [
        (s.tool, s.args, s.observation) for s in result.steps
    ]


async def test_budgets(make_client: Any) -> None:
    async with replay_server([SCRIPT], timing=FixedTiming(0.0, 0.0)) as url:
        result, _ = await _run(url, make_client, max_turns=2)
        assert result.stop_reason == "max_turns" and len(result.steps) == 2
    async with replay_server([SCRIPT], timing=FixedTiming(0.3, 0.01)) as url:
        start = time.monotonic()
        result, _ = await _run(url, make_client, max_seconds=0.8)
        assert time.monotonic() - start < 3
        assert result.stop_reason == "time_budget" and 1 <= len(result.steps) <= 2


async def test_tools_start_before_the_message_ends(make_client: Any) -> None:
    started: dict[str, float] = {}

    async def mark(ws: Workspace, args: dict[str, Any]) -> ToolResult:
        started[args["label"]] = time.monotonic()
        return ToolResult("ok")

    mark_tool = Tool("mark", "record a time", {"type": "object", "properties": {"label": {"type": "string"}}}, mark)
    long_command = {"command": "echo " + " ".join(f"word{i}" for i in range(40))}
    script = traj(
        "early",
        Step("mark", {"label": "a"}, turn=0),
        Step("bash", long_command, turn=0),
        Step("mark", {"label": "b"}, turn=0),
        Step(None, assistant_text="done"),
    )
    async with replay_server([script], timing=FixedTiming(0.0, 0.01)) as url:
        async with Workspace() as ws:
            with anyio.fail_after(30):
                result = await run_agent(make_client(url), "replay:early:0", "t", ws, tools=[mark_tool, bash_tool()])
    # Call 0 ran while the ~50 fragments of call 1 were still streaming.
    assert started["b"] - started["a"] > 0.3
    assert [s.tool for s in result.steps] == ["mark", "bash", "mark", None]
    assert result.steps[1].observation == "exit code 0\n" + long_command["command"][5:] + "\n"
    assert [s.turn for s in result.steps] == [0, 0, 0, 1]
    assert result.steps[0].llm_seconds and result.steps[1].llm_seconds == 0.0


async def test_unusable_tool_call_propagates(make_client: Any) -> None:
    script = traj("bad", Step("python", {"code": "1"}), Step(None))
    async with replay_server([script], timing=FixedTiming(0.0, 0.0)) as url:
        with pytest.raises(ToolCallError, match="'python'"):
            await _run(url, make_client, model="replay:bad:0")
