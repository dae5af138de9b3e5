"""Run the minimal agent loop in a real Workspace against the replay server, and print the trajectory.

    python examples/replay_agent.py            # a built-in four-step trajectory (ls, write, read, answer)
    python examples/replay_agent.py --live     # the same task against OPENAI_BASE_URL / OPENAI_API_KEY (--model)

Needs root (workspaces) and the ``openai`` package.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import anyio
import openai

from bunshin_async import Workspace
from bunshin_async.agent import run_agent
from bunshin_async.llm import RecordedTiming, ReplayServer
from bunshin_async.rollout import Step, Trajectory, dump_trajectories

TASK = "Create f.txt containing 'hi' in the current directory, check it, then say what it contains."

RECORDED = Trajectory(
    task_id="hello",
    rollout=0,
    steps=[
        Step("bash", {"command": "ls"}, llm_seconds=0.6, assistant_text="Let me look around first."),
        Step("bash", {"command": "echo hi > f.txt"}, llm_seconds=0.4),
        Step("bash", {"command": "cat f.txt"}, llm_seconds=0.3),
        Step(None, llm_seconds=0.5, assistant_text="f.txt contains: hi"),
    ],
)


async def run(client: openai.AsyncOpenAI, model: str) -> Trajectory:
    async with Workspace() as ws:
        return await run_agent(client, model, TASK, ws, task_id="hello", max_turns=10, max_seconds=300)


def show(trajectory: Trajectory) -> None:
    for step in trajectory.steps:
        what = f"{step.tool} {step.args}" if step.tool else f"answer {step.assistant_text!r}"
        print(f"turn {step.turn}: {what}  llm {step.llm_seconds or 0:.2f} s  tool {step.tool_seconds or 0:.3f} s")
        if step.observation:
            print("   ", step.observation.strip().replace("\n", "\n    "))
    print(f"stop: {trajectory.stop_reason}, {trajectory.wall_seconds:.2f} s")
    print(trajectory.to_json().decode()[:2000])


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", action="store_true", help="use OPENAI_BASE_URL / OPENAI_API_KEY instead")
    parser.add_argument("--model", default="gpt-4o-mini")
    args = parser.parse_args()
    if args.live:
        async with openai.AsyncOpenAI() as client:
            show(await run(client, args.model))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = dump_trajectories(Path(tmp) / "hello.jsonl", [RECORDED])  # the trajectory file format
        async with ReplayServer(path, timing=RecordedTiming()) as server:
            print(f"replay server on {server.base_url}")
            async with openai.AsyncOpenAI(base_url=server.base_url, api_key="replay") as client:
                show(await run(client, "replay:hello:0"))
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))
