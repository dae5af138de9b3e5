"""A minimal agent loop on the turn runtime, for differential tests and benchmarks: it replays a trajectory from
an OpenAI-compatible endpoint (the replay server) with the real ``openai`` SDK and runs every tool call in a real
workspace, with speculation on or off. It is not the product's agent loop (``bunshin_async.agent``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from bunshin_async import ExecResult
from bunshin_async._llm._openai import tap_openai_stream
from bunshin_async._tools import Tool
from bunshin_async.speculation import CallResult, RolloutMetrics, Speculation, TurnMetrics, WorkspaceHandle, run_turn

__all__ = ["CallTrace", "RolloutTrace", "observation", "replay_rollout", "workspace_state"]


class CallTrace(msgspec.Struct, frozen=True):
    """What a call did, as the differential test compares it: tool, canonical arguments, result fingerprint."""

    tool: str
    arguments: str
    outcome: str


class RolloutTrace(msgspec.Struct, kw_only=True):
    calls: list[CallTrace]
    stop_reason: str
    final_state: str
    wall_seconds: float
    metrics: RolloutMetrics
    turns: list[TurnMetrics]


def observation(r: CallResult) -> str:
    """What the model is told about a call's outcome."""
    if r.error is not None:
        return f"error: {type(r.error).__name__}: {r.error}"
    res = r.result
    if isinstance(res, ExecResult):
        return f"exit code {res.exit_code}\n{res.stdout}{res.stderr}"
    if res is None:
        return "ok"
    return msgspec.json.encode(res).decode()


async def workspace_state(handle: WorkspaceHandle) -> str:
    """Files of the workspace directory with their contents' hashes, and the processes running in it."""
    ws = handle.workspace
    files = await ws.exec("cd /workspace && find . -xdev \\( -type f -o -type l \\) -print0 | sort -z | "
                          "xargs -0 -r sha256sum; find . -xdev -type d | sort", timeout=30)  # fmt: skip
    procs = await ws.exec(["ps", "-eo", "args="], timeout=30)
    running = sorted(p for p in procs.stdout.splitlines() if "bunshin" not in p and not p.startswith("ps "))
    return files.stdout + "--\n" + "\n".join(running)


async def replay_rollout(
    client: Any,
    model: str,
    handle: WorkspaceHandle,
    tools: Sequence[Tool],
    speculation: Speculation | None,
    *,
    max_turns: int = 100,
    start_early: bool | None = None,
) -> RolloutTrace:
    """Run the conversation ``model`` (``replay:<task>:<rollout>``) serves to its end."""
    specs = [t.spec() for t in tools]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "replay"}]
    calls: list[CallTrace] = []
    turns: list[TurnMetrics] = []
    stop = "max_turns"
    started = time.monotonic()
    for _ in range(max_turns):
        stream = await client.chat.completions.create(
            model=model, messages=messages, tools=specs, stream=True, stream_options={"include_usage": True}
        )
        async with tap_openai_stream(stream, specs, keep_chunks=False) as tap:
            outcome = await run_turn(tap, handle, tools, speculation, start_early=start_early)
        turns.append(outcome.metrics)
        msg = outcome.message
        assistant: dict[str, Any] = {"role": "assistant", "content": msg.content or None}
        if msg.tool_calls:
            assistant["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.raw}}
                for c in msg.tool_calls
            ]
        messages.append(assistant)
        for r in outcome.results:
            text = observation(r)
            messages.append({"role": "tool", "tool_call_id": r.call.id, "content": text})
            args = msgspec.json.encode(r.call.arguments, order="deterministic").decode()
            calls.append(CallTrace(r.call.name, args, text))
        if not msg.tool_calls:
            stop = msg.finish_reason
            break
    wall = time.monotonic() - started
    return RolloutTrace(
        calls=calls,
        stop_reason=stop,
        final_state=await workspace_state(handle),
        wall_seconds=wall,
        metrics=handle.metrics,
        turns=turns,
    )
