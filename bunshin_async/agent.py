"""A minimal agent loop: stream a turn from any OpenAI-compatible endpoint, run its tool calls in a ``Workspace``,
repeat until the model answers without a tool call or a budget runs out, and record the ``Trajectory``.

A tool call starts as soon as the tap reports its arguments complete, while the rest of the message is still
streaming (``start_tools_early``); calls of one message run one after another, in order.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec

from ._exceptions import ToolError, ToolTimeout
from ._llm._events import ArgumentsComplete, MessageFinished, ToolCall, UsageReported
from ._llm._openai import tap_openai_stream
from ._trajectory import Step, Trajectory
from ._workspace import Workspace

__all__ = ["DEFAULT_SYSTEM_PROMPT", "Tool", "ToolHandler", "ToolResult", "bash_tool", "run_agent"]

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent working in a Linux workspace. Use the tools to inspect and change it. "
    "When the task is done, answer with a short summary and no tool call."
)


class ToolResult(msgspec.Struct, frozen=True):
    """What a tool returns to the model (``output``) and, for commands, their ``exit_code``."""

    output: str
    exit_code: int | None = None


#: ``handler(workspace, arguments)``; arguments are already validated against the tool's schema. Raise
#: ``ToolError`` for a failure the model should see; anything else aborts the run.
ToolHandler = Callable[[Workspace, dict[str, Any]], Awaitable[ToolResult]]


class Tool(msgspec.Struct, frozen=True):
    """A tool the model may call: ``parameters`` is its JSON schema (the subset ``bunshin_async.llm`` validates)."""

    name: str
    description: str
    parameters: dict[str, Any]
    handler: ToolHandler

    def spec(self) -> dict[str, Any]:
        """The chat-completions ``tools=`` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters elided ...]\n{text[-half:]}"


def _text(data: str | bytes) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def bash_tool(*, timeout: float = 120.0, max_output_chars: int = 10_000) -> Tool:
    """The ``bash`` tool: ``{"command": str}`` runs through bash in the workspace with ``timeout`` seconds; the model
    sees the exit code and the output (stdout then stderr, the middle elided past ``max_output_chars``)."""

    async def run(ws: Workspace, args: dict[str, Any]) -> ToolResult:
        try:
            result = await ws.exec(args["command"], timeout=timeout)
        except ToolTimeout as exc:
            partial = _text(exc.stdout) + _text(exc.stderr)
            return ToolResult(_clip(f"timed out after {timeout:g} s\n{partial}", max_output_chars), exit_code=None)
        return ToolResult(
            _clip(f"exit code {result.exit_code}\n{result.stdout}{result.stderr}", max_output_chars),
            exit_code=result.exit_code,
        )

    return Tool(
        name="bash",
        description="Run a bash command in the workspace and return its exit code and output.",
        parameters={
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command line"}},
            "required": ["command"],
        },
        handler=run,
    )


@asynccontextmanager
async def _one_error() -> AsyncIterator[None]:
    """Let a task group's single failure out as itself (anyio wraps it in an ExceptionGroup)."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


class _Executed(msgspec.Struct):
    result: ToolResult
    seconds: float


async def _execute(tools: Mapping[str, Tool], ws: Workspace, call: ToolCall) -> _Executed:
    start = time.monotonic()
    try:
        result = await tools[call.name].handler(ws, call.arguments)
    except ToolError as exc:
        result = ToolResult(f"error: {exc}")
    return _Executed(result, time.monotonic() - start)


async def run_agent(
    client: Any,
    model: str,
    task: str,
    workspace: Workspace,
    *,
    tools: Sequence[Tool] | None = None,
    system: str | None = DEFAULT_SYSTEM_PROMPT,
    max_turns: int = 30,
    max_seconds: float | None = None,
    task_id: str = "task",
    rollout: int = 0,
    start_tools_early: bool = True,
    request_options: Mapping[str, Any] | None = None,
) -> Trajectory:
    """Run ``task`` to its end and return the trajectory.

    ``client`` is an ``openai.AsyncOpenAI`` (or anything with the same ``chat.completions.create``); point it at the
    replay server or at any endpoint (``OPENAI_BASE_URL``/``OPENAI_API_KEY``). ``tools`` defaults to ``[bash_tool()]``.
    Budgets: ``max_turns`` model calls, ``max_seconds`` of wall-clock (the turn in flight is cancelled and dropped).
    ``stop_reason`` of the result is the last ``finish_reason`` (``stop``, ``length``), ``max_turns`` or
    ``time_budget``. Errors of the endpoint and unusable tool calls (``ToolCallError``) propagate.
    """
    tool_list = list(tools) if tools is not None else [bash_tool()]
    by_name = {t.name: t for t in tool_list}
    specs = [t.spec() for t in tool_list]
    messages: list[dict[str, Any]] = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": task}
    ]
    steps: list[Step] = []
    stop_reason = "max_turns"
    started = time.monotonic()
    with anyio.move_on_after(max_seconds if max_seconds is not None else float("inf")) as budget:
        for turn in range(max_turns):
            finished, usage, llm_seconds, executed = await _turn(
                client, model, messages, specs, by_name, workspace, start_tools_early, request_options or {}
            )
            assistant: dict[str, Any] = {"role": "assistant", "content": finished.content or None}
            if finished.tool_calls:
                assistant["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.raw}}
                    for c in finished.tool_calls
                ]
            messages.append(assistant)
            if not finished.tool_calls:
                steps.append(
                    Step(None, None, llm_seconds, assistant_text=finished.content, turn=turn,
                         completion_tokens=usage.completion_tokens if usage else None,
                         prompt_tokens=usage.prompt_tokens if usage else None)
                )  # fmt: skip
                stop_reason = finished.finish_reason
                break
            for n, call in enumerate(finished.tool_calls):
                done = executed[call.index]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": done.result.output})
                steps.append(
                    Step(
                        call.name, call.arguments, llm_seconds if n == 0 else 0.0, done.seconds,
                        assistant_text=(finished.content or None) if n == 0 else None, turn=turn, call_id=call.id,
                        observation=done.result.output, exit_code=done.result.exit_code,
                        completion_tokens=usage.completion_tokens if usage and n == 0 else None,
                        prompt_tokens=usage.prompt_tokens if usage and n == 0 else None,
                    )
                )  # fmt: skip
    if budget.cancelled_caught:
        stop_reason = "time_budget"
    return Trajectory(
        task_id=task_id,
        rollout=rollout,
        steps=steps,
        model=model,
        stop_reason=stop_reason,
        wall_seconds=time.monotonic() - started,
        messages=messages,
    )


async def _turn(
    client: Any,
    model: str,
    messages: list[dict[str, Any]],
    specs: list[dict[str, Any]],
    tools: Mapping[str, Tool],
    ws: Workspace,
    early: bool,
    options: Mapping[str, Any],
) -> tuple[MessageFinished, Any, float, dict[int, _Executed]]:
    """One model call; its tool calls run as their arguments complete (or after the message, if not ``early``)."""
    executed: dict[int, _Executed] = {}
    send, receive = anyio.create_memory_object_stream[ToolCall](max_buffer_size=64)

    async def worker() -> None:
        async with receive:
            async for call in receive:
                executed[call.index] = await _execute(tools, ws, call)

    start = time.monotonic()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        tools=specs,
        stream=True,
        stream_options={"include_usage": True},
        **options,
    )
    finished: MessageFinished | None = None
    usage = None
    async with _one_error(), anyio.create_task_group() as tg, send:
        tg.start_soon(worker)
        async with tap_openai_stream(stream, specs, keep_chunks=False) as tap:
            async for event in tap:
                if isinstance(event, ArgumentsComplete) and early:
                    await send.send(event.call)
                elif isinstance(event, MessageFinished):
                    finished = event
                    if not early:
                        for call in event.tool_calls:
                            await send.send(call)
                elif isinstance(event, UsageReported):
                    usage = event.usage
    assert finished is not None  # the tap raises when the stream ends without finishing
    return finished, usage, finished.t - start, executed
