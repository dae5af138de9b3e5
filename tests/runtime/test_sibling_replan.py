"""A sibling's decision plans a turn again (``Speculation.signal``, ``GroupSignal``): the turn runtime's own logic
without a workspace (reads of tools that never touch one, hand-made stream events), as in test_ahead.py. While
rollout B's message streams, rollout A of its group decides a call; B's predictors, which learned it, are asked
again and B's read of that call starts before B's model names it, and B's turn commits it. Not
from the state A decided it in: there the prefix cache serves it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import anyio
import pytest

from bunshin_async._llm._events import ArgumentsComplete, MessageFinished, TapEvent, ToolCall, ToolNameKnown
from bunshin_async.speculation import (
    BoundedPolicy,
    CallKey,
    Candidate,
    GroupSignal,
    PredictionContext,
    Speculation,
    WorkspaceHandle,
    run_turn,
)

from .test_ahead import _Executor, _Probe

pytestmark = pytest.mark.unit


class _Siblings:
    """Predicts (p = 0.9) whatever a sibling decided, from any state: the group's shared ``decided`` list."""

    name = "siblings"

    def __init__(self, decided: list[str]) -> None:
        self.decided = decided

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        return [Candidate(name=n, arguments={}, probability=0.9, source=self.name) for n in self.decided]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.decided.append(call.name)


class _Rollout:
    def __init__(self, decided: list[str], signal: GroupSignal | None, salt: str) -> None:
        self.probe = _Probe("probe")
        self.executor = _Executor([self.probe.tool()])
        self.handle = WorkspaceHandle.over(self.executor, salt=salt)  # the salt: the state a rollout starts in
        self.spec = Speculation(predictors=[_Siblings(decided)], policy=BoundedPolicy(), keep=0, signal=signal)


def _call() -> ToolCall:
    return ToolCall(index=0, id="c0", name="probe", arguments={}, raw="{}")


async def _message_after(started: anyio.Event, ready: anyio.Event) -> AsyncIterator[TapEvent]:
    """A message that names ``probe`` only once ``ready`` is set (``started``: the stream is being read)."""
    started.set()
    with anyio.fail_after(10):  # no re-plan: the probe never starts before it is named, and the test fails here
        await ready.wait()
    yield ToolNameKnown(index=0, id="c0", name="probe", t=0.0)
    yield ArgumentsComplete(call=_call(), t=0.0)
    yield MessageFinished(finish_reason="tool_calls", content="", tool_calls=[_call()], t=0.0)


async def _message() -> AsyncIterator[TapEvent]:
    yield ArgumentsComplete(call=_call(), t=0.0)
    yield MessageFinished(finish_reason="tool_calls", content="", tool_calls=[_call()], t=0.0)


async def test_a_siblings_decision_starts_the_call_in_a_turn_still_streaming() -> None:
    decided: list[str] = []
    signal = GroupSignal()
    a, b = _Rollout(decided, signal, "a"), _Rollout(decided, signal, "b")
    streaming = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def run_b() -> None:
            outcome = await run_turn(_message_after(streaming, b.probe.started), b.handle, b.executor.tools, b.spec)
            assert (outcome.results[0].result, outcome.results[0].source) == ("probe output", "speculated")
            assert (outcome.metrics.launched, outcome.metrics.committed) == (1, 1)

        tg.start_soon(run_b)
        await streaming.wait()
        assert b.probe.runs == 0  # nothing predicted at its turn's start: no sibling had decided yet
        outcome = await run_turn(_message(), a.handle, a.executor.tools, a.spec)
        assert outcome.metrics.launched == 0  # its own decision plans nothing again for itself
    assert b.probe.runs == 1  # the branch's run served B's call
    # B's turn ended: it no longer listens (a later decision plans nothing for it)
    signal.notify(a, CallKey(name="probe", version="", args=b"{}"), b"")
    assert b.probe.runs == 1


async def test_without_the_groups_signal_a_turn_plans_at_its_own_points_only() -> None:
    """The same group without a ``GroupSignal``: B's call runs only once its model names it."""
    decided: list[str] = []
    b = await _a_decides_while_b_streams(_Rollout(decided, None, "a"), _Rollout(decided, None, "b"), decided)
    assert b.probe.runs == 1


async def test_a_siblings_call_from_the_same_state_is_left_to_the_cache() -> None:
    """A and B stand in the same state: A's call is not launched for B (a write in flight is the cache's single
    flight, a read the cache's once it ended), though B's predictors name it."""
    decided: list[str] = []
    signal = GroupSignal()
    b = await _a_decides_while_b_streams(_Rollout(decided, signal, "t"), _Rollout(decided, signal, "t"), decided)
    assert b.probe.runs == 1


async def _a_decides_while_b_streams(a: _Rollout, b: _Rollout, decided: list[str]) -> _Rollout:
    """A's turn decides ``probe`` while B's message streams: B launches nothing before its model names the call
    (asserted), then runs it itself; returns B."""
    ready, streaming = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:

        async def run_b() -> None:
            outcome = await run_turn(_message_after(streaming, ready), b.handle, b.executor.tools, b.spec)
            assert (outcome.metrics.launched, outcome.metrics.committed) == (0, 0)

        tg.start_soon(run_b)
        await streaming.wait()
        await run_turn(_message(), a.handle, a.executor.tools, a.spec)
        assert decided == ["probe"] and b.probe.runs == 0
        ready.set()
    return b


async def test_a_siblings_failing_replan_does_not_fail_the_notifier(caplog: pytest.LogCaptureFixture) -> None:
    """A re-plan is advisory: one sibling's that raises is logged, the other siblings still plan, and the notifying
    rollout goes on; a cancellation (not an ``Exception``) is not swallowed."""
    signal, told = GroupSignal(), []
    call = CallKey(name="probe", version="", args=b"{}")

    def broken(key: CallKey, state: bytes) -> None:
        raise RuntimeError("a sibling's predictor failed")

    a, b, c = object(), object(), object()
    with signal.subscribed(b, broken), signal.subscribed(c, lambda key, state: told.append((key, state))):
        signal.notify(a, call, b"s")  # does not raise
        assert told == [(call, b"s")]
        assert "re-plan after probe failed" in caplog.text and "a sibling's predictor failed" in caplog.text

        def cancelled(key: CallKey, state: bytes) -> None:
            raise anyio.get_cancelled_exc_class()()

        with signal.subscribed(b, cancelled), pytest.raises(anyio.get_cancelled_exc_class()):
            signal.notify(a, call, b"s")
