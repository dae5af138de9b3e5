"""One agent turn as a task graph: the LLM stream feeds the tool-call tap, predicted calls start as speculative
branches, decided calls are matched against them, and the winner's result (and, for a write, its workspace) is
committed while the losers are cancelled and closed.

Who runs where (all tasks live in the turn's task group; each branch has its own ``CancelScope``):

- ``pump`` (this module): reads the tap events; an ``ArgumentsComplete`` decides call ``i`` and starts its
  main-line task; after each decision point the turn plans launches (``_launcher``, over ``_planning``'s pure
  functions of what the predictors proposed, what is in flight and the cache's veto; the policy selects within
  its budgets); once every call has its result, with kept branches, it launches the next turn's first call.
- main line (``_mainline``), one task per decided call, in message order: a read/pure call waits for the previous
  write of the message, a write/external call for every previous call (the order the plain agent loop runs them).
  When due, it takes the branch started for the identical call (same tool, same canonical arguments, same
  starting state) if one exists (or a near miss, ``_nearmiss``), else runs the call in the current workspace.
- branches (``_branches``), one task each: a ``write`` candidate runs in a fork of the current workspace, a
  ``pure``/``read`` one in the workspace itself (only while no write of this turn is pending or running, so it
  sees the committed state); ``external`` and nondeterministic calls are never speculated.

Without a ``Speculation`` the turn is the plain agent loop: nothing is predicted and every call runs on the main
line after the previous one. A state change (a write ran, or a write branch was committed) makes every other
branch stale: they are cancelled and their forks closed. Cleanup is shielded, with a deadline.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._exceptions import BunshinError, UsageError, unwrap_group
from .._llm._events import (
    ArgumentsComplete,
    MessageFinished,
    TapEvent,
    TextDelta,
    ToolCall,
    ToolNameKnown,
    Usage,
    UsageReported,
)
from .._tools._tools import Effect, Tool
from ._branches import BranchSet
from ._calls import CallKey
from ._handle import WorkspaceHandle
from ._launcher import Launcher
from ._mainline import Decided, MainLine
from ._metrics import TurnLog, TurnMetrics
from ._nearmiss import filtered
from ._planning import Planner
from ._results import CallResult, TurnOutcome
from ._speculation import Speculation, policy_active

__all__ = ["SpeculativeTurn", "run_turn"]


class SpeculativeTurn:
    """One turn of an agent loop. ``speculation=None`` is the plain path (calls run in order), with the same API
    and results, for differential comparison::

        async with SpeculativeTurn(handle, tools, speculation) as turn:
            async for item in turn.feed(tap):          # TapEvents as they come, CallResults as soon as ready
                ...
            outcome = await turn.results()

    ``tools`` are ``bunshin_async.tools.Tool``s (their effect classes decide what may be speculated); a call of any
    other tool raises ``ToolCallError``, as the plain agent loop does. The turn owns the branches it starts; leaving
    the block (also by cancellation or error) cancels them and closes their forks.
    After the turn ``handle.workspace`` is the workspace every call of the turn ran in, in order.
    """

    def __init__(
        self,
        handle: WorkspaceHandle,
        tools: Sequence[Tool] | Mapping[str, Tool],
        speculation: Speculation | None = None,
        *,
        start_early: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.handle = handle
        self.tools: dict[str, Tool] = dict(tools) if isinstance(tools, Mapping) else {t.name: t for t in tools}
        self.speculation = speculation
        self.early = (speculation.early if speculation is not None else False) if start_early is None else start_early
        self._log = TurnLog(TurnMetrics(turn=handle.turns), clock)
        self._branches = BranchSet(handle, self.tools, speculation, self._log)
        self._planner = Planner(handle, self.tools, speculation, self._log)
        self._launcher = launcher = Launcher(handle, speculation, self._planner, self._branches, self._log)
        self._branches.on_ready = launcher.chain
        self._main = MainLine(
            handle, self.tools, speculation, self._branches, self._log, early=self.early, emit=self._emit,
            after=launcher.replan,
        )  # fmt: skip
        launcher.main = self._main
        self._branches.earlier = self._earlier
        self._tg: TaskGroup | None = None
        self._out: MemoryObjectSendStream[TapEvent | CallResult] | None = None
        self._in: MemoryObjectReceiveStream[TapEvent | CallResult] | None = None
        self._finished: MessageFinished | None = None
        self._complete = anyio.Event()
        self._usage: Usage | None = None
        self._t_message = 0.0
        self._fed = False

    @property
    def metrics(self) -> TurnMetrics:
        """This turn's speculation metrics and timeline (complete once ``results()`` returned)."""
        return self._log.metrics

    # ------------------------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> SpeculativeTurn:
        self.handle.turns += 1
        self._log.t0 = self._log.clock()
        self._log.mark("turn_start")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = self._launcher.tg = tg
        kept, self.handle.kept = self.handle.kept, []
        for b in kept:  # the previous turn's unused branches: still valid (no state change since), now ours
            self._branches.adopt(b)
        if not self._launcher.keeping:
            self._branches.cancel(lambda b: True)
        for b in kept:  # a write that finished after its turn ended has not chained yet
            if b.ok and b.launch.needs_fork and not b.children and not b.discarded:
                self._launcher.chain(b)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        tg, self._tg = self._tg, None
        assert tg is not None
        self._launcher.closing = True
        failed = exc is not None or not self._complete.is_set()
        if failed:
            tg.cancel_scope.cancel()
            for b in list(self.handle.kept):
                if b.owner is self._branches:
                    self._branches.discard(b)
            self._branches.cancel(lambda b: True)
        else:
            self._branches.cancel(lambda b: not b.kept)
        try:
            async with unwrap_group():
                await tg.__aexit__(exc_type, exc, tb)
        finally:
            for stream in (self._out, self._in):  # the pump or the relay may never have started to close them
                if stream is not None:
                    stream.close()
            with anyio.CancelScope(shield=True):
                if failed:  # branches running in the handle's task group close their own forks: wait for them
                    await self._branches.wait_finished([], started_only=True)
                await self._branches.close_leftovers(settling_too=failed)
        return None

    def feed(self, events: AsyncIterable[TapEvent]) -> AsyncIterator[TapEvent | CallResult]:
        """Consume the tap's events; yields them through, interleaved with each ``CallResult`` as soon as it is
        ready. Call once per turn (or ``consume``)."""
        self._start_feed()
        send, receive = anyio.create_memory_object_stream[TapEvent | CallResult](math.inf)
        self._out, self._in = send, receive
        assert self._tg is not None
        self._tg.start_soon(self._pump, events, send)
        return self._relay(receive)

    async def consume(
        self, events: AsyncIterable[TapEvent], on_result: Callable[[CallResult], object] | None = None
    ) -> TurnOutcome:
        """Run the turn from the tap's ``events`` in this task to the last call's result, relaying nothing (``feed``
        passes every event through a stream: a task switch per streamed chunk); ``on_result`` is called with each
        result as soon as it is ready."""
        self._start_feed()
        self._main.on_result = on_result
        await self._pump(events, None)
        return await self.results()

    def _start_feed(self) -> None:
        if self._tg is None:
            raise UsageError("use `async with SpeculativeTurn(...) as turn` before feeding it", what="SpeculativeTurn")
        if self._fed:
            raise UsageError("a turn is fed once", what="SpeculativeTurn.feed")
        self._fed = True

    @staticmethod
    async def _relay(receive: MemoryObjectReceiveStream[TapEvent | CallResult]) -> AsyncIterator[TapEvent | CallResult]:
        async with receive:
            async for item in receive:
                yield item

    async def results(self) -> TurnOutcome:
        """Wait until every call of the message has its result; the turn's outcome."""
        await self._complete.wait()
        assert self._finished is not None
        return TurnOutcome(
            message=self._finished,
            results=[self._main.results[d.call.index] for d in self._main.decided],
            usage=self._usage,
            metrics=self.metrics,
        )

    # ------------------------------------------------------------------------------------------ the stream

    async def _pump(
        self, events: AsyncIterable[TapEvent], send: MemoryObjectSendStream[TapEvent | CallResult] | None
    ) -> None:
        mark = self._log.mark
        async with send if send is not None else contextlib.nullcontext(), self._siblings():
            self._launcher.replan()
            first = True
            async for ev in events:
                if first and isinstance(ev, TextDelta | ToolNameKnown):
                    mark("first_token")
                    first = False
                if isinstance(ev, ToolNameKnown):
                    mark("tool_name", ev.index, ev.name)
                    self._cancel_wrong_name(ev.index, ev.name)
                elif isinstance(ev, ArgumentsComplete):
                    mark("arguments_complete", ev.call.index, ev.call.name)
                    self._decide(ev.call)
                elif isinstance(ev, MessageFinished):
                    self._on_finished(ev)
                elif isinstance(ev, UsageReported):
                    self._usage = ev.usage
                self._emit(ev)
            mark("stream_end")
            if self._finished is None:  # the tap raises first; a hand-made event source might not
                raise BunshinError("the event stream ended before the message finished")
            for d in self._main.decided:
                await d.done.wait()
            ahead = self._launcher.ahead()  # every observation is known: the next turn's first call may start
            self._launcher.closing = True
            keeping = self._launcher.keeping
            limit = self.speculation.keep if self.speculation is not None and keeping else 0
            self.handle.kept = await self._branches.hand_over(limit, ahead, background=keeping)
            self._finalize()
            self._complete.set()

    @contextlib.asynccontextmanager
    async def _siblings(self) -> AsyncIterator[None]:
        """While the stream runs, a sibling's decision (``Speculation.signal``) plans this turn's next call again
        (``Launcher.replan`` does nothing once the message finished)."""
        signal = self.speculation.signal if self.speculation is not None else None
        with signal.subscribed(self, self._launcher.sibling) if signal is not None else contextlib.nullcontext():
            yield

    def _emit(self, item: TapEvent | CallResult) -> None:
        if self._out is not None:
            try:
                self._out.send_nowait(item)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._out = None  # the caller stopped reading; the turn still completes

    def _on_finished(self, ev: MessageFinished) -> None:
        self._finished = ev
        self._launcher.calls = len(ev.tool_calls)
        self._t_message = self._log.clock()
        observe_llm = getattr(self.speculation.policy, "observe_llm", None) if self.speculation else None
        if observe_llm is not None:
            observe_llm(self._t_message - self._log.t0)
        self._log.mark("message_finished", len(ev.tool_calls), ev.finish_reason)
        known = {d.call.index for d in self._main.decided}
        for call in ev.tool_calls:
            if call.index not in known:
                self._decide(call)
        n = len(ev.tool_calls)
        if not self._launcher.keeping:
            self._branches.cancel(lambda b: b.position >= n)
        self._main.message.set()

    def _cancel_wrong_name(self, position: int, name: str) -> None:
        keep_done = self._launcher.keeping
        self._branches.cancel(
            lambda b: b.position == position and b.key.name != name and not (keep_done and b.done.is_set())
        )

    # ------------------------------------------------------------------------------------------ decisions

    def _decide(self, call: ToolCall) -> None:
        position = len(self._main.decided)
        if self.speculation is None or not policy_active(self.speculation):
            # Plain or paused: nothing will be speculated, so the call's effect class (a parse of its command) buys
            # nothing; run it as a write, in the plain loop's order, making any branch still alive stale.
            key, effect = self._planner.key(call.name, call.arguments), Effect.WRITE
        else:
            key, effect, _ = self._planner.classify(call.name, call.arguments)
        if key is not None:
            if self.speculation is not None:
                ctx = self._launcher.context(position)
                for predictor in self.speculation.predictors:
                    predictor.observe(ctx, key)
                if self.speculation.signal is not None:  # the group's turns in flight plan again with it
                    self.speculation.signal.notify(self, key, ctx.chain)
            self.handle.record(key)
        d = Decided(call, position, key, effect, self._log.clock())
        tool = self.tools.get(call.name)
        near = filtered(tool, key) if tool is not None and key is not None else None
        wanted = {key, near[0] if near else None}
        self._planner.score(position, wanted)
        skip = self.speculation.skip if self.speculation is not None else None
        for b in self._branches.live:  # a read run in place that this call takes: its pids stay (``ReadPids``)
            if not b.launch.needs_fork and b.key in wanted and b.parent is None and b.epoch == self.handle.epoch:
                b.ran = not (skip is not None and skip(b.launch))  # the cache would serve it: no process
                if b.pids is not None:  # (else its scope has not begun: ``_taken`` tells it)
                    b.pids.use(ran=b.ran)
        # A finished branch for another call may stay (its state is unchanged until a write: a later call may want
        # it, and it costs only memory); one still running for another call goes (it takes CPU from the rollouts).
        keep_done = self._launcher.keeping
        self._branches.cancel(
            lambda b: b.position == position and b.key not in wanted and not (keep_done and b.done.is_set())
        )
        assert self._tg is not None
        self._main.start(d, self._tg)
        self._launcher.replan()

    def _earlier(self, position: int, key: CallKey) -> list[anyio.Event]:
        """The ends of the main line's calls before ``position`` that a read run in place for it waits for (they
        start as they are decided: ``early``), but those that would take its result (its key, or a near miss)."""
        if not self.early:
            return []
        ends = []
        for d in self._main.decided[:position]:
            tool = self.tools.get(d.call.name)
            near = filtered(tool, d.key) if tool is not None and d.key is not None else None
            if d.key != key and (near is None or near[0] != key):
                ends.append(d.done)
        return ends

    def _finalize(self) -> None:
        self._log.finalized = True
        m = self.metrics
        end = max(self._main.t_last, self._t_message)
        m.calls = len(self._main.decided)
        m.predicted = len(self._planner.predicted)
        m.llm_seconds = self._t_message - self._log.t0
        m.tool_seconds = max(0.0, end - self._t_message)
        m.turn_seconds = end - self._log.t0
        m.handover_seconds = max(0.0, self._log.clock() - end)
        self._log.mark("turn_end")
        self.handle.metrics.add(m)
        if self.speculation is not None:
            self.speculation.metrics.add(m)
            self.speculation.turns.append(m)


async def run_turn(
    events: AsyncIterable[TapEvent],
    handle: WorkspaceHandle,
    tools: Sequence[Tool] | Mapping[str, Tool],
    speculation: Speculation | None = None,
    *,
    start_early: bool | None = None,
    on_result: Callable[[CallResult], object] | None = None,
) -> TurnOutcome:
    """Run one turn from the tap's ``events`` to the last call's result (see ``SpeculativeTurn``); ``on_result`` is
    called with each result as soon as it is ready."""
    async with SpeculativeTurn(handle, tools, speculation, start_early=start_early) as turn:
        return await turn.consume(events, on_result)
