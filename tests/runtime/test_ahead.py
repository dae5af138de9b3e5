"""Launching on the observation (``Speculation.on_observation``), the turn runtime's own logic without a workspace:
in-place reads of tools that never touch one, over a minimal executor, with hand-made stream events. Once every call
of a message has its result, the call predicted to open the next turn starts before that turn's model request is
made; the next turn commits it when the model asks for it, cancels it when the model asks for something else, and
leaving the rollout (or cancelling it) cancels it. Forks of real workspaces: tests/speculation/test_ahead.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anyio
import pytest

from bunshin_async._llm._events import ArgumentsComplete, MessageFinished, TapEvent, ToolCall, ToolNameKnown
from bunshin_async.speculation import (
    BoundedPolicy,
    CallKey,
    Candidate,
    Launch,
    PredictionContext,
    Speculation,
    TurnOutcome,
    WorkspaceHandle,
    run_turn,
)
from bunshin_async.tools import Effect, Tool

pytestmark = pytest.mark.unit


class _Executor:
    """Runs the calls of tools that ignore their workspace (``workspace`` is a placeholder no tool touches)."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools = {t.name: t for t in tools}
        self.workspace: Any = object()
        self.adopted: list[str] = []

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Any:
        handler = self.tools[tool].handler
        assert handler is not None
        return await handler(self.workspace, dict(args or {}))

    async def adopt(self, workspace: Any, tool: str, args: Mapping[str, Any], result: Any, duration: float) -> None:
        self.adopted.append(tool)


class _Probe:
    """A read whose runs are counted; ``release`` holds every run until set (a run that is cancelled says so)."""

    def __init__(self, name: str, *, hold: bool = False) -> None:
        self.name, self.runs, self.cancelled = name, 0, 0
        self.started = anyio.Event()
        self.release = anyio.Event()
        if not hold:
            self.release.set()

    def tool(self) -> Tool:
        async def run(ws: Any, args: dict[str, Any]) -> str:
            self.runs += 1
            self.started.set()
            try:
                await self.release.wait()
            except anyio.get_cancelled_exc_class():
                self.cancelled += 1
                raise
            return f"{self.name} output"

        return Tool(name=self.name, effect=Effect.READ, handler=run)


class _After:
    """Predicts ``then`` (p = 0.9) as the call after ``first``; remembers every context it was asked in."""

    name = "after"

    def __init__(self, first: str, then: str) -> None:
        self.first, self.then = first, then
        self.asked: list[PredictionContext] = []

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        self.asked.append(ctx)
        history = [*ctx.history, *ctx.decided[: ctx.position]]
        if history and history[-1].name == self.first:
            return [Candidate(name=self.then, arguments={}, probability=0.9, source=self.name)]
        return []

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass


def _step_tool() -> Tool:
    async def run(ws: Any, args: dict[str, Any]) -> str:
        return "step output"

    return Tool(name="step", effect=Effect.WRITE, handler=run)


async def _message(*names: str) -> AsyncIterator[TapEvent]:
    calls = [ToolCall(index=i, id=f"c{i}", name=n, arguments={}, raw="{}") for i, n in enumerate(names)]
    for c in calls:
        yield ToolNameKnown(index=c.index, id=c.id, name=c.name, t=0.0)
        yield ArgumentsComplete(call=c, t=0.0)
    yield MessageFinished(finish_reason="tool_calls" if calls else "stop", content="", tool_calls=calls, t=0.0)


class _Recording(BoundedPolicy):
    """``BoundedPolicy`` that remembers the options it was offered."""

    def __init__(self) -> None:
        super().__init__()
        self.offered: list[Launch] = []

    def select(self, options: Sequence[Launch], *, running: int, forks: int) -> list[Launch]:
        self.offered += options
        return super().select(options, running=running, forks=forks)


class _Rollout:
    def __init__(self, *, hold: bool = False, on_observation: bool = True, keep: int = 2) -> None:
        self.probe, self.other = _Probe("probe", hold=hold), _Probe("other")
        self.executor = _Executor([_step_tool(), self.probe.tool(), self.other.tool()])
        self.handle = WorkspaceHandle.over(self.executor, salt="t")
        self.predictor = _After("step", "probe")
        self.policy = _Recording()
        self.spec = Speculation(
            predictors=[self.predictor], policy=self.policy, on_observation=on_observation, keep=keep
        )

    async def turn(self, *names: str) -> TurnOutcome:
        return await run_turn(_message(*names), self.handle, self.executor.tools, self.spec)


async def _the_request_waits_for(probe: _Probe) -> None:
    """The next model request: it goes out only once the predicted call runs (a launch at the next turn's start
    would never come: the test fails at the deadline instead of hanging)."""
    with anyio.fail_after(10):
        await probe.started.wait()


async def test_the_next_turns_call_starts_on_the_observation_and_commits() -> None:
    r = _Rollout()
    async with r.handle.background():
        await r.turn("step")
        await _the_request_waits_for(r.probe)
        second = await r.turn("probe")
    assert [x.source for x in second.results] == ["speculated"] and second.results[0].result == "probe output"
    assert r.probe.runs == 1 and r.executor.adopted == ["probe"]  # run once, by the branch
    first_turn, next_turn = r.spec.turns
    assert first_turn.launched == 1 and next_turn.launched_ahead == 1 and next_turn.ahead_seconds > 0
    [branch] = next_turn.branches
    assert branch.ahead and branch.outcome == "committed" and branch.launched_at < 0  # before its turn started
    # predicted for the next turn's first call, from the state and the observation the first turn ended with
    ahead = [c for c in r.predictor.asked if c.turn == 1][0]
    assert (ahead.position, ahead.decided, ahead.last_output) == (0, (), "step output")
    assert [k.name for k in ahead.history] == ["step"]
    # offered as a launch with the whole next turn's LLM time ahead of it (none of it has passed)
    [offered] = [o for o in r.policy.offered if o.key.name == "probe"]
    assert offered.turn_elapsed == 0.0 and offered.depth == 0 and offered.progress == 1


async def test_a_call_the_model_does_not_ask_for_is_cancelled() -> None:
    r = _Rollout(hold=True)  # the predicted call is still running when the model asks for another one
    async with r.handle.background():
        await r.turn("step")
        await _the_request_waits_for(r.probe)
        second = await r.turn("other")
    assert [x.source for x in second.results] == ["executed"] and second.results[0].result == "other output"
    assert r.probe.cancelled == 1 and r.executor.adopted == []
    [branch] = r.spec.turns[1].branches
    assert branch.ahead and branch.outcome == "wasted"
    assert r.spec.metrics.wasted == 1 and r.spec.metrics.committed == 0


@pytest.mark.parametrize("how", ["final answer", "cancelled"])
async def test_leaving_the_rollout_cancels_what_was_launched_ahead(how: str) -> None:
    r = _Rollout(hold=True)
    with anyio.CancelScope() as scope:
        async with r.handle.background():
            await r.turn("step")
            await _the_request_waits_for(r.probe)
            if how == "cancelled":
                scope.cancel()  # the rollout is cancelled while its next model request is in flight
                await anyio.sleep_forever()
            await r.turn()  # the model answers without a call: the rollout ends
    assert r.probe.cancelled == 1 and r.handle.kept == [] and r.handle.tasks is None
    branches = [b for t in r.spec.turns for b in t.branches]
    assert [(b.ahead, b.outcome) for b in branches] == [(True, "wasted")]
    assert r.spec.metrics.launched == 1 and r.spec.metrics.wasted == 1


@pytest.mark.parametrize("off", ["on_observation=False", "keep=0", "no background"])
async def test_without_it_the_call_starts_with_the_next_turn(off: str) -> None:
    r = _Rollout(on_observation=off != "on_observation=False", keep=0 if off == "keep=0" else 2)
    async with r.handle.background() if off != "no background" else _nothing():
        await r.turn("step")
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        assert not r.probe.started.is_set() and r.spec.turns[0].launched == 0
        second = await r.turn("probe")
    assert r.probe.runs == 1 and r.spec.turns[1].launched_ahead == 0
    assert second.results[0].source in ("speculated", "executed")


class _nothing:  # noqa: N801 (an async context manager that does nothing)
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None
