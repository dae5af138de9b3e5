from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import anyio

from bunshin_async.llm import FixedTiming, MessageFinished, replay_server, tap_openai_stream
from bunshin_async.rollout import iter_trajectories
from tests._traces import SHARED_TRACE

BASH = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


async def test_replays_the_shared_trace(tmp_path: Path, make_client: Any) -> None:
    """The real trace format (gzip JSONL, extra fields, format_error and submit steps) replays turn by turn."""
    assert SHARED_TRACE.exists(), f"{SHARED_TRACE} (../shared/traces beside the checkout) is missing"
    with gzip.open(SHARED_TRACE, "rb") as f:
        head = b"".join(f.readline() for _ in range(3))
    path = tmp_path / "head.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(head)
    trajectories = list(iter_trajectories(path))
    first = trajectories[0]
    async with replay_server(path, timing=FixedTiming(0.0, 0.0)) as url:
        client = make_client(url)
        models = await client.models.list()
        assert {m.id for m in models.data} == {f"replay:{t.task_id}:0" for t in trajectories}
        messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the issue"}]
        calls = []
        with anyio.fail_after(60):
            for _ in range(len(first.steps) + 1):
                model = f"replay:{first.task_id}:0"
                stream = await client.chat.completions.create(model=model, messages=messages, tools=BASH, stream=True)
                events = [e async for e in tap_openai_stream(stream, BASH)]
                finished = next(e for e in events if isinstance(e, MessageFinished))
                if finished.finish_reason == "stop":
                    break
                [call] = finished.tool_calls
                calls.append(call.arguments)
                messages.append(
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": call.id, "type": "function", "function": {"name": "bash", "arguments": call.raw}}
                        ],
                    }  # fmt: skip
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "(replayed elsewhere)"})
    expected = [s.args for s in first.steps if s.tool == "bash"]
    assert calls == expected
