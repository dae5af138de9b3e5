"""A minimal agent loop: stream a turn from any OpenAI-compatible endpoint, run its tool calls, repeat until the
model answers without a tool call or a budget runs out, and record the ``Trajectory``.

Tools are ``bunshin_async.tools.Tool``s (the built-in ``bash_tool`` by default). Calls run through a
``ToolExecutor``: directly in one workspace, or through a ``CachedSession`` of the tool cache, where a write hit
can move the rollout into a restored workspace. A tool call starts as soon as the tap reports its arguments
complete, while the rest of the message is still streaming (``start_tools_early``); calls of one message run one
after another, in order.

With a ``Speculation`` each turn runs through the speculative turn runtime (``bunshin_async.speculation``):
predicted calls start while the model generates (reads in place, writes in forks) and a decided call takes its
matching branch, which the executor then ``adopt``s; every other call runs through the executor as without it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from contextlib import AsyncExitStack
from typing import Any, Protocol

import anyio
import msgspec

from ._exceptions import BunshinError, InvalidValue, ToolError, ToolTimeout
from ._host._protocol import ExecResult
from ._llm._events import MessageFinished
from ._llm._openai import tap_openai_stream
from ._rollout._trajectory import Step, Trajectory
from ._runtime._calls import Launch
from ._runtime._handle import Executor, WorkspaceHandle, WorkspaceSlot
from ._runtime._speculation import Speculation
from ._runtime._turn import run_turn
from ._tools._tools import Tool, bash_tool, lookup
from ._workspace._facade import Workspace

__all__ = ["DEFAULT_SYSTEM_PROMPT", "ToolExecutor", "ToolResult", "WorkspaceExecutor", "observation", "run_agent"]

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent working in a Linux workspace. Use the tools to inspect and change it. "
    "When the task is done, answer with a short summary and no tool call."
)


class ToolExecutor(Protocol):
    """What runs an agent's tool calls: ``WorkspaceExecutor``, or a ``bunshin_async.cache.CachedSession``.

    ``call`` returns the tool's result or raises its ``ToolError``. ``workspace`` is the workspace the rollout is
    in *now*: a call may replace it (a cached write restored into a fork), and whoever owns the rollout reads it
    at the end to score and close it.
    """

    @property
    def tools(self) -> Mapping[str, Tool]: ...

    @property
    def workspace(self) -> Workspace: ...

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Any: ...


class WorkspaceExecutor:
    """Runs every call in ``workspace``, arguments normalized as the cache does (defaults filled in).

    With speculation a committed write moves the rollout into the branch's fork (``adopt``): ``workspace`` is then
    that fork, which the executor owns (closed when replaced, or by ``aclose``) until ``detach()`` hands it to the
    caller. ``own`` says whether the executor closes the first workspace too."""

    def __init__(self, workspace: Workspace, tools: Iterable[Tool], *, own: bool = False) -> None:
        self._slot = WorkspaceSlot(workspace, own=own)
        self.tools = {t.name: t for t in tools}

    @property
    def workspace(self) -> Workspace:
        return self._slot.workspace

    def detach(self) -> Workspace:
        """The current workspace, from now on the caller's to close."""
        return self._slot.detach()

    async def adopt(
        self, workspace: Workspace, tool: str, args: Mapping[str, Any], result: Any, duration: float
    ) -> None:
        """A speculative branch ran this call in ``workspace`` (a fork, for a write): continue there."""
        await self._slot.swap(workspace)

    async def move(self, workspace: Workspace) -> None:
        """Continue in ``workspace``, a speculative write's fork whose call still runs (``adopt`` follows)."""
        await self._slot.swap(workspace)

    async def aclose(self) -> None:
        """Close the current workspace if the executor owns it. Idempotent."""
        await self._slot.aclose()

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Any:
        t = lookup(self.tools, tool)
        if t.handler is None:
            raise ToolError(f"tool {tool!r} has no handler", tool=tool)
        return await t.handler(self.workspace, t.normalize(args or {}))


class ToolResult(msgspec.Struct, frozen=True):
    """What the model sees of a call (``output``) and, for commands, their ``exit_code``."""

    output: str
    exit_code: int | None = None


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters elided ...]\n{text[-half:]}"


def observation(outcome: Any, *, max_chars: int = 10_000) -> ToolResult:
    """What the model is told about a call's result or error: a command's exit code and output (stdout then
    stderr, the middle elided past ``max_chars``), a timeout with what was printed, ``error: ...`` for another
    ``BunshinError``, text as it is, ``ok`` for no result, anything else as JSON."""
    exit_code = None
    if isinstance(outcome, ExecResult):
        text, exit_code = f"exit code {outcome.exit_code}\n{outcome.stdout}{outcome.stderr}", outcome.exit_code
    elif isinstance(outcome, ToolTimeout):
        text = f"timed out after {outcome.timeout:g} s\n{outcome.stdout}{outcome.stderr}"
    elif isinstance(outcome, BunshinError):
        text = f"error: {outcome}"
    elif isinstance(outcome, str):
        text = outcome
    elif outcome is None:
        text = "ok"
    else:
        text = msgspec.json.encode(outcome).decode()
    return ToolResult(_clip(text, max_chars), exit_code)


class _Executed(msgspec.Struct):
    result: ToolResult
    seconds: float


async def run_agent(
    client: Any,
    model: str,
    task: str,
    workspace: Workspace | ToolExecutor,
    *,
    tools: Iterable[Tool] | None = None,
    system: str | None = DEFAULT_SYSTEM_PROMPT,
    max_turns: int = 30,
    max_seconds: float | None = None,
    task_id: str = "task",
    rollout: int = 0,
    start_tools_early: bool = True,
    request_options: Mapping[str, Any] | None = None,
    max_output_chars: int = 10_000,
    speculation: Speculation | None = None,
) -> Trajectory:
    """Run ``task`` to its end and return the trajectory.

    ``client`` is an ``openai.AsyncOpenAI`` (or anything with the same ``chat.completions.create``); point it at the
    replay server or at any endpoint (``OPENAI_BASE_URL``/``OPENAI_API_KEY``).

    ``workspace`` is where the ``tools`` (default ``[bash_tool()]``) run, or a ``ToolExecutor`` that runs its own
    tools (``tools`` must then be None): with a ``CachedSession`` calls are served from the tool cache, and the
    rollout ends in ``session.workspace``, which a write hit may have replaced. What the model sees of a call is
    ``observation(result, max_chars=max_output_chars)``.
    Budgets: ``max_turns`` model calls, ``max_seconds`` of wall-clock (the turn in flight is cancelled and dropped).
    ``stop_reason`` of the result is the last ``finish_reason`` (``stop``, ``length``), ``max_turns`` or
    ``time_budget``. Errors of the endpoint and unusable tool calls (``ToolCallError``) propagate.

    ``speculation`` (e.g. ``speculator.default_speculation(group=task_id, ...)``) runs each turn speculatively; its
    ``metrics`` sum the turns. A committed write moves the rollout into a fork, so ``workspace`` must then be an
    executor the caller reads the live workspace from afterwards (a ``CachedSession``, or a ``WorkspaceExecutor``:
    ``detach()`` it); ``task_id`` keys the sibling predictor's histories, so rollouts of one group must share it.
    Calls a ``CachedSession`` would serve are not speculated (its ``would_hit`` joins ``speculation.skip``).
    """
    if isinstance(workspace, Workspace):
        if speculation is not None:
            raise InvalidValue(
                "with speculation the rollout may move into a fork: pass WorkspaceExecutor(ws, tools) (or a "
                "CachedSession) and read its .workspace (detach()) afterwards, not the workspace itself",
                argument="workspace",
            )
        executor: ToolExecutor = WorkspaceExecutor(workspace, tools if tools is not None else [bash_tool()])
    elif tools is not None:
        raise InvalidValue(
            "an executor brings its own tools: give them to it (cache.session(ws, tools)), not here", argument="tools"
        )
    else:
        executor = workspace
    if speculation is not None:
        if not isinstance(executor, Executor):
            raise InvalidValue(
                f"speculation needs an executor with adopt() (see speculation.Executor), not {executor!r}",
                argument="workspace",
            )
        speculation = _with_cache_skip(speculation, executor)
    handle = WorkspaceHandle.over(executor, salt=task_id)
    specs = [t.spec() for t in executor.tools.values()]
    messages: list[dict[str, Any]] = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": task}
    ]
    steps: list[Step] = []
    stop_reason = "max_turns"
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        if speculation is not None:  # branches may outlive their turn (Speculation.keep); closed when the loop ends
            await stack.enter_async_context(handle.background())
            stack.callback(_rollout_done, speculation, handle)
        stop_reason = await _loop(
            client, model, messages, specs, executor, handle, speculation, steps, start_tools_early,
            request_options or {}, max_output_chars, max_turns, max_seconds,
        )  # fmt: skip
    return Trajectory(
        task_id=task_id,
        rollout=rollout,
        steps=steps,
        model=model,
        stop_reason=stop_reason,
        wall_seconds=time.monotonic() - started,
        messages=messages,
    )


def _rollout_done(speculation: Speculation | None, handle: WorkspaceHandle) -> None:
    done = getattr(speculation.policy, "rollout_done", None) if speculation is not None else None
    if done is not None:
        done(handle.name)


async def _loop(
    client: Any,
    model: str,
    messages: list[dict[str, Any]],
    specs: list[dict[str, Any]],
    executor: ToolExecutor,
    handle: WorkspaceHandle,
    speculation: Speculation | None,
    steps: list[Step],
    start_tools_early: bool,
    request_options: Mapping[str, Any],
    max_output_chars: int,
    max_turns: int,
    max_seconds: float | None,
) -> str:
    """``run_agent``'s turns; appends to ``messages`` and ``steps``, returns the stop reason."""
    stop_reason = "max_turns"
    with anyio.move_on_after(max_seconds if max_seconds is not None else float("inf")) as budget:
        for turn in range(max_turns):
            finished, usage, llm_seconds, executed = await _turn(
                client, model, messages, specs, executor, handle, speculation, start_tools_early,
                request_options or {}, max_output_chars,
            )  # fmt: skip
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
    return stop_reason


def _with_cache_skip(speculation: Speculation, executor: ToolExecutor) -> Speculation:
    """``speculation`` whose ``skip`` also vetoes calls ``executor`` would serve from its cache (``would_hit``)."""
    would_hit = getattr(executor, "would_hit", None)
    if would_hit is None:
        return speculation
    inner = speculation.skip

    def skip(launch: Launch) -> bool:
        return bool(would_hit(launch.key.name, launch.key.arguments())) or (inner is not None and inner(launch))

    return dataclasses.replace(speculation, skip=skip)


async def _turn(
    client: Any,
    model: str,
    messages: list[dict[str, Any]],
    specs: list[dict[str, Any]],
    executor: ToolExecutor,
    handle: WorkspaceHandle,
    speculation: Speculation | None,
    early: bool,
    options: Mapping[str, Any],
    max_chars: int,
) -> tuple[MessageFinished, Any, float, dict[int, _Executed]]:
    """One model call through the turn runtime (``run_turn``; the plain loop without ``speculation``): its tool
    calls run through ``executor`` (via ``handle``) as their arguments complete (after the message, if not
    ``early``), one after another."""
    start = time.monotonic()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        tools=specs,
        stream=True,
        stream_options={"include_usage": True},
        **options,
    )
    early = early and (speculation is None or speculation.early)
    async with tap_openai_stream(stream, specs, keep_chunks=False) as tap:
        outcome = await run_turn(tap, handle, executor.tools, speculation, start_early=early)
    finished = outcome.message
    executed: dict[int, _Executed] = {}
    for r in outcome.results:  # a call of an unknown tool raised ToolCallError in the turn
        result = observation(r.error if r.error is not None else r.result, max_chars=max_chars)
        executed[r.call.index] = _Executed(result, r.seconds)
    return finished, outcome.usage, finished.t - start, executed
