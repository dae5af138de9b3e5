"""The product's agent loop (``run_agent``) as the speculation tests drive it: the same replayed conversation with
speculation off (the plain loop: no turn runtime at all) or on (``WorkspaceExecutor`` + ``Speculation``), and the
final workspace state both must agree on."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import httpx2 as httpx
import msgspec
import openai

from bunshin_async import Workspace
from bunshin_async._rollout._state import workspace_state
from bunshin_async.agent import WorkspaceExecutor, run_agent
from bunshin_async.speculation import RolloutMetrics, Speculation, TurnMetrics
from bunshin_async.tools import Tool


class Call(msgspec.Struct, frozen=True):
    """What a call did, as the differential tests compare it: tool, canonical arguments, what the model saw."""

    tool: str
    arguments: str
    outcome: str


class Run(msgspec.Struct, kw_only=True):
    calls: list[Call]
    stop_reason: str
    final_state: str
    wall_seconds: float
    moved: bool  # the rollout ended in a committed fork, not in the workspace it started in
    metrics: RolloutMetrics
    turns: list[TurnMetrics]


_canon = msgspec.json.Encoder(order="deterministic")


class _Held(httpx.AsyncBaseTransport):
    """HTTP to the replay server, the body of the ``nth`` response held until ``gate`` is set: that turn's message
    cannot finish before then, however long what sets it takes on this machine."""

    def __init__(self, nth: int, gate: anyio.Event) -> None:
        self.inner, self.nth, self.gate, self.n = httpx.AsyncHTTPTransport(), nth, gate, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        self.n += 1
        if self.n != self.nth:
            return response
        stream, gate = response.stream, self.gate
        assert isinstance(stream, httpx.AsyncByteStream)
        body: httpx.AsyncByteStream = stream  # (narrowed for the class below)

        class Stream(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                with anyio.fail_after(120):
                    await gate.wait()
                async for chunk in body:
                    yield chunk

            async def aclose(self) -> None:
                await body.aclose()

        return httpx.Response(response.status_code, headers=response.headers, stream=Stream(),
                              extensions=response.extensions)  # fmt: skip

    async def aclose(self) -> None:
        await self.inner.aclose()


def held_client(client: Any, nth: int, gate: anyio.Event) -> openai.AsyncOpenAI:
    """A client of ``client``'s replay server whose ``nth`` response (counted from 1) is held until ``gate`` is set:
    a test that needs a branch to have started before its call is due says so, instead of hoping the machine forks
    faster than the scripted turn (close it: ``await held.close()``)."""
    http = httpx.AsyncClient(transport=_Held(nth, gate))
    return openai.AsyncOpenAI(base_url=str(client.base_url), api_key="test", max_retries=0, http_client=http)


def signalling_tools(tools: Sequence[Tool], command: str) -> tuple[list[Tool], anyio.Event]:
    """``tools`` whose bash sets the returned event when a call of ``command`` starts (before the model asks for it,
    only a branch runs it): what a ``held_client`` waits for."""
    started = anyio.Event()
    out = []
    for tool in tools:
        run = tool.handler
        if tool.name == "bash" and run is not None:

            async def handler(ws: Any, args: Any, run: Any = run) -> Any:
                if args["command"] == command:
                    started.set()
                return await run(ws, args)

            tool = msgspec.structs.replace(tool, handler=handler)
        out.append(tool)
    return out, started


async def agent_rollout(
    client: Any, model: str, ws: Workspace, tools: Sequence[Tool], speculation: Speculation | None, *,
    task_id: str = "task", rollout: int = 0, early: bool = True,
) -> Run:  # fmt: skip
    """Replay ``model`` (``replay:<task>:<rollout>``) to its end through ``run_agent`` in ``ws`` (the caller's to
    close); with ``speculation`` a committed write moves the rollout into a fork, closed here after the state was
    read."""
    options: dict[str, Any] = {"system": None, "max_turns": 100, "task_id": task_id, "rollout": rollout,
                               "start_tools_early": early}  # fmt: skip
    if speculation is None:
        traj = await run_agent(client, model, "replay", ws, tools=list(tools), **options)
        final, moved = ws, False
    else:
        executor = WorkspaceExecutor(ws, tools)
        try:
            traj = await run_agent(client, model, "replay", executor, speculation=speculation, **options)
            final, moved = executor.workspace, executor.workspace is not ws
            state = await workspace_state(final)
        finally:
            await executor.aclose()
    calls = [Call(s.tool, _canon.encode(s.args or {}).decode(), s.observation or "") for s in traj.steps if s.tool]
    return Run(
        calls=calls,
        stop_reason=traj.stop_reason or "",
        final_state=state if speculation is not None else await workspace_state(final),
        wall_seconds=traj.wall_seconds or 0.0,
        moved=moved,
        metrics=speculation.metrics if speculation is not None else RolloutMetrics(),
        turns=list(speculation.turns) if speculation is not None else [],
    )


async def off_and_on(
    client: Any, model: str, tools: Sequence[Tool], speculation: Speculation, *,
    on_client: Any = None, on_tools: Sequence[Tool] | None = None,
) -> tuple[Run, Run]:  # fmt: skip
    """The same replay with speculation off (the plain loop) and on, each in a fresh workspace: both must make the
    same calls with the same results and leave the same final state (the run with speculation on through
    ``on_client`` and ``on_tools`` when given)."""
    async with Workspace() as ws0:
        off = await agent_rollout(client, model, ws0, tools, None)
    async with Workspace() as ws1:
        on = await agent_rollout(on_client or client, model, ws1, on_tools or tools, speculation)
    assert off.final_state.startswith("0\n"), off.final_state  # the probe ran
    assert on.calls == off.calls and on.final_state == off.final_state
    return off, on
