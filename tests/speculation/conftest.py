"""Speculation tests: real workspaces and forks (CRIU), scripted turns served by the real replay server over
loopback and consumed with the real ``openai`` SDK (the root conftest checks nothing is left after each test)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import openai
import pytest

from bunshin_async._host._paths import criu_binary
from bunshin_async.llm import RecordedTiming, ReplayServer
from bunshin_async.rollout import Step, Trajectory
from tests.conftest import is_unit

# Tests of the runtime's mechanics give CostAwarePolicy contention=None: how busy this shared machine's CPUs are is
# not what they test (test_lead_time.py tests the back-off under a full CPU).


@pytest.fixture(autouse=True)
def _needs_criu(request: pytest.FixtureRequest) -> None:
    if not is_unit(request.node):
        assert criu_binary() is not None, "speculation tests need CRIU: run `make setup`"


def bash(command: str, *, llm: float = 0.03, turn: int | None = None, text: str = "") -> Step:
    return Step("bash", {"command": command}, llm_seconds=llm, turn=turn, assistant_text=text or None)


def final(llm: float = 0.02) -> Step:
    return Step(None, None, llm_seconds=llm, assistant_text="done")


def trajectory(task: str, steps: Sequence[Step], rollout: int = 0) -> Trajectory:
    return Trajectory(task_id=task, rollout=rollout, steps=list(steps))


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    """``async with serve(trajectories) as client``: a replay server (recorded LLM time) and an openai client."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def run(trajs: Sequence[Trajectory], **options: Any) -> AsyncIterator[openai.AsyncOpenAI]:
        options.setdefault("timing", RecordedTiming(ttft=0.01))
        async with ReplayServer(list(trajs), **options) as server:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            try:
                yield client
            finally:
                await client.close()

    yield run
