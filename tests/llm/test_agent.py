"""The agent loop in a real Workspace against the replay server, through the openai SDK."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bunshin_async import ToolCallError, Workspace
from bunshin_async.agent import run_agent
from bunshin_async.cache import ForkStateProvider, ToolCache
from bunshin_async.llm import FixedTiming, RecordedTiming, replay_server
from bunshin_async.rollout import (
    GroupRollout,
    RolloutContext,
    Step,
    Task,
    Trajectory,
    dump_trajectories,
    load_trajectories,
)
from bunshin_async.tools import Tool, bash_tool, builtin_tools

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
    for step in result.steps:  # the recorded 0.1 s each, never less (how much more is the machine's load)
        assert step.llm_seconds is not None and step.llm_seconds >= 0.1 - 0.005
    assert all(s.tool_seconds is not None and s.tool_seconds > 0 for s in result.steps[:3])
    assert result.steps[-1].tool_seconds is None
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
        # What load cannot change: the budget ends the run, not before 0.8 s, and no third 0.3 s turn fits in it
        # (how many fit on a loaded machine, 1 or 2 or none, is its speed's).
        assert time.monotonic() - start >= 0.8 - 0.005
        assert result.stop_reason == "time_budget" and len(result.steps) <= 2


class _Counted:
    """The SDK's chat-completions client, counting the chunks the agent has read of the stream it asked for, and
    whether one of them ended the message."""

    def __init__(self, client: Any) -> None:
        self.client, self.read, self.finished = client, 0, False
        self.chat = self.completions = self

    async def create(self, **kw: Any) -> Any:
        return self._stream(await self.client.chat.completions.create(**kw))

    async def _stream(self, stream: Any) -> Any:
        async with stream:
            async for chunk in stream:
                self.read += 1
                self.finished |= any(choice.finish_reason for choice in chunk.choices)
                yield chunk


async def test_tools_start_before_the_message_ends(make_client: Any) -> None:
    counted = _Counted(None)
    seen: dict[str, tuple[int, bool]] = {}  # label -> (chunks read, message ended) when the call ran

    async def mark(ws: Workspace, args: dict[str, Any]) -> str:
        seen[args["label"]] = (counted.read, counted.finished)
        return "ok"

    mark_tool = Tool(
        name="mark",
        description="record how far the stream was read",
        schema={"type": "object", "properties": {"label": {"type": "string"}}},
        handler=mark,
        result_type=str,
    )
    long_command = {"command": "echo " + " ".join(f"word{i}" for i in range(40))}
    script = traj(
        "early",
        Step("mark", {"label": "a"}, turn=0),
        Step("bash", long_command, turn=0),
        Step("mark", {"label": "b"}, turn=0),
        Step(None, assistant_text="done"),
    )
    async with replay_server([script], timing=FixedTiming(0.0, 0.01)) as url:
        counted.client = make_client(url)
        async with Workspace() as ws:
            with anyio.fail_after(30):
                result = await run_agent(counted, "replay:early:0", "t", ws, tools=[mark_tool, bash_tool()])
    # Call 0 ran while the message was still streaming, before the ~50 fragments of call 1 had been read.
    (read_a, ended_a), (read_b, _) = seen["a"], seen["b"]
    assert not ended_a and read_b - read_a > 20, seen
    assert [s.tool for s in result.steps] == ["mark", "bash", "mark", None]
    assert result.steps[1].observation == "exit code 0\n" + long_command["command"][5:] + "\n"
    assert [s.turn for s in result.steps] == [0, 0, 0, 1]
    assert result.steps[0].llm_seconds and result.steps[1].llm_seconds == 0.0


async def test_unusable_tool_call_propagates(make_client: Any) -> None:
    script = traj("bad", Step("python", {"code": "1"}), Step(None))
    async with replay_server([script], timing=FixedTiming(0.0, 0.0)) as url:
        with pytest.raises(ToolCallError, match="'python'"):
            await _run(url, make_client, model="replay:bad:0")


class CachedReplayAgent:
    """A ``RolloutAgent``: ``run_agent`` with its tools routed through a session of a shared ``ToolCache``. The
    session owns the rollout's workspace while it runs and hands the live one back in ``ctx.ws`` (a write hit may
    have replaced it), for the group to score and close."""

    def __init__(self, client: Any, cache: ToolCache, tools: list[Tool]) -> None:
        self.client, self.cache, self.tools = client, cache, tools

    async def run(self, ctx: RolloutContext) -> Trajectory:
        async with self.cache.session(ctx.ws, self.tools, own=True, salt=ctx.task.task_id) as session:
            try:
                return await run_agent(
                    self.client, f"replay:{ctx.task.task_id}:0", ctx.task.prompt, session, task_id=ctx.task.task_id
                )
            finally:
                ctx.ws = session.detach()


async def test_a_second_rollout_forks_through_the_cached_writes(make_client: Any) -> None:
    listening = "(echo > /dev/tcp/127.0.0.1/8000) 2>/dev/null"
    start_server = f"python3 -m http.server 8000 >/dev/null 2>&1 & until {listening}; do sleep 0.05; done"
    script = traj(
        "cached",
        Step("bash", {"command": "echo hi > f.txt"}),
        Step("bash", {"command": start_server}),
        Step("bash", {"command": "cat f.txt"}),
        Step("write_file", {"path": "g.txt", "content": "done"}),
        Step(None, assistant_text="f.txt says hi and a server runs."),
    )
    task = Task(task_id="cached", prompt="t", reward_command=f"grep -q hi f.txt && {listening}")
    executions: Counter[str] = Counter()

    def counted(tool: Tool) -> Tool:
        inner = tool.handler
        assert inner is not None

        async def run(ws: Workspace, args: dict[str, Any]) -> Any:
            executions[tool.name] += 1
            return await inner(ws, args)

        return msgspec.structs.replace(tool, handler=run)

    tools = [counted(t) for t in builtin_tools()]
    results = []
    async with (
        replay_server([script], timing=FixedTiming(0.0, 0.0)) as url,
        ToolCache(provider=ForkStateProvider()) as cache,
    ):
        agent = CachedReplayAgent(make_client(url), cache, tools)
        for _ in range(2):
            with anyio.fail_after(60):
                async with GroupRollout(task, 1, agent, fork=False) as group:
                    results += await group.collect()
            if not results[1:]:
                assert executions == {"bash": 3, "write_file": 1}
                executions.clear()
        m = cache.metrics()
    assert executions == {}  # the second rollout ran nothing: 3 writes forked, 1 read served
    assert m.restores == 3 and m.by_effect["write"].hits == 3 and m.by_effect["read"].hits == 1
    first, second = (r.trajectory for r in results)
    assert first is not None and second is not None
    assert [(s.tool, s.observation) for s in second.steps] == [(s.tool, s.observation) for s in first.steps]
    # The reward ran in the rollout's live workspace (the last fork): the file and the server are there.
    assert [(r.status, r.reward, r.fork_mode != "fresh") for r in results] == [
        ("finished", 1.0, False),
        ("finished", 1.0, True),
    ]
