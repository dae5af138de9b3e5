from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from bunshin_async.rollout import Step, Trajectory

BASH_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
READ_SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "max_lines": {"type": "integer"}},
    "required": ["path"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": BASH_SCHEMA}},
    {"type": "function", "function": {"name": "read", "description": "read a file", "parameters": READ_SCHEMA}},
]


def traj(task_id: str, *steps: Step, rollout: int = 0) -> Trajectory:
    return Trajectory(task_id=task_id, rollout=rollout, steps=list(steps))


@pytest.fixture
async def make_client() -> AsyncIterator[Any]:
    clients: list[openai.AsyncOpenAI] = []

    def make(base_url: str, **kwargs: Any) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="test", **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
