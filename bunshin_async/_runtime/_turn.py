"""One agent turn as a task graph: the LLM stream feeds the tool-call tap, predicted calls start as speculative
branches, decided calls are matched against them, and the winner's result (and, for a write, its workspace) is
committed while the losers are cancelled and closed.

Who runs where (all tasks live in the turn's task group; each branch has its own ``CancelScope``):

- ``pump``: reads the tap events; an ``ArgumentsComplete`` decides call ``i`` and starts its main-line task.
- main line, one task per decided call, in message order: a read/pure call waits for the previous write of the
  message, a write/external call for every previous call (the order the plain agent loop runs them). When due, it
  takes the branch started for the identical call (same tool, same canonical arguments, same starting state) if
  one exists, else runs the call in the current workspace (through the handle's ``Executor`` when it has one, so
  a tool cache can serve it; a committed branch is then handed to ``Executor.adopt``).
- branches, one task each: a ``write`` candidate runs in a fork of the current workspace, a ``pure``/``read`` one
  in the workspace itself (only while no write of this turn is pending or running, so it sees the committed state);
  ``external`` and nondeterministic calls are never speculated.

A state change (a write ran, or a write branch was committed) makes every other branch stale: they are cancelled
and their forks closed. Cleanup is shielded, with a deadline.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from .._accounting import tree_bytes
from .._exceptions import BunshinError, InvalidArgument, ToolError, unwrap_group
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
from .._protocol import ExecResult
from .._tools import Effect, Tool, lookup
from .._workspace import Workspace
from ._calls import CallKey, Candidate, Launch, Policy, PredictionContext, Predictor
from ._handle import CLOSE_DEADLINE, WorkspaceHandle
from ._metrics import BranchRecord, EventKind, RolloutMetrics, TimelineEvent, TurnMetrics

FORK_DEADLINE = 60.0

__all__ = ["BoundedPolicy", "CallResult", "Speculation", "SpeculativeTurn", "TurnOutcome", "run_turn"]


class CallResult(msgspec.Struct, frozen=True, kw_only=True):
    """A decided call's outcome, yielded by ``SpeculativeTurn.feed`` as soon as it is ready (possibly before the
    message ends). ``error`` is the ``ToolError`` the tool raised (a result for the model, not a failure of the
    turn); ``source`` says whether a speculative branch produced it; ``seconds`` is the tool's own run time and
    ``t`` the ``time.monotonic()`` at which the result became available."""

    index: int
    call: ToolCall
    result: Any = None
    error: Any = None  # ToolError | None
    source: Literal["executed", "speculated"] = "executed"
    seconds: float = 0.0
    t: float = 0.0


class TurnOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """The finished turn: the model's message, the results of its calls in call order, usage and metrics."""

    message: MessageFinished
    results: list[CallResult]
    usage: Usage | None
    metrics: TurnMetrics


class BoundedPolicy:
    """The fallback policy: launch the most probable options while fewer than ``max_branches`` run and fewer than
    ``max_forks`` forks exist, if their probability is at least ``min_probability``. ``speculator`` has the
    cost-aware one."""

    def __init__(self, max_branches: int = 2, max_forks: int = 1, min_probability: float = 0.0) -> None:
        self.max_branches, self.max_forks, self.min_probability = max_branches, max_forks, min_probability

    def select(self, options: Sequence[Launch], *, running: int, forks: int) -> list[Launch]:
        out: list[Launch] = []
        for option in options:
            if running >= self.max_branches:
                break
            if option.candidate.probability < self.min_probability:
                continue
            if option.needs_fork:
                if forks >= self.max_forks:
                    continue
                forks += 1
            running += 1
            out.append(option)
        return out

    def observe_tool(self, key: CallKey, seconds: float) -> None:
        pass

    def observe_fork(self, seconds: float, memory_bytes: int) -> None:
        pass


@dataclass
class Speculation:
    """What to speculate with: ``predictors`` (asked at every decision point), the ``policy`` that chooses
    launches, ``group`` (rollouts that share a sibling table pass the same name), and ``early``: start a call
    as soon as the tap saw its arguments complete (the stream tap as a predictor of certainty). ``skip`` vetoes
    launches (pass one that says whether the prefix cache would serve the call: such calls are not speculated).
    One ``Speculation`` may serve many turns and rollouts: the policy learns across them; ``metrics`` sums the
    turns run with it (make one per rollout, sharing the policy and the predictors' tables, to get per-rollout
    metrics) and ``turns`` keeps each turn's own metrics, in order."""

    predictors: Sequence[Predictor] = ()
    policy: Policy = field(default_factory=BoundedPolicy)
    group: str = ""
    early: bool = True
    skip: Callable[[Launch], bool] | None = None
    metrics: RolloutMetrics = field(default_factory=RolloutMetrics)
    turns: list[TurnMetrics] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ internals


class _Branch:
    def __init__(self, launch: Launch, position: int, epoch: int, t: float) -> None:
        self.launch = launch
        self.key = launch.key
        self.position = position
        self.epoch = epoch
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.ws: Workspace | None = None
        self.forked = False
        self.ok = False
        self.result: Any = None
        self.error: ToolError | None = None
        self.claimed = False
        self.discarded = False
        self.launched_at = t
        self.fork_seconds = 0.0
        self.run_start = 0.0
        self.run_end = 0.0
        self.cpu_seconds = 0.0
        self.memory_bytes = 0
        self.failed = False
        self.committed = False
        self.used = False
        self.saved = 0.0
        self.released = anyio.Event()
        self.finished = anyio.Event()
        self.tail: int | None = None  # committed as a near miss: keep the last ``tail`` lines of stdout


class _Decided:
    def __init__(self, call: ToolCall, position: int, key: CallKey | None, effect: Effect, t: float) -> None:
        self.call = call
        self.position = position
        self.key = key
        self.effect = effect
        self.t = t
        self.done = anyio.Event()

    @property
    def changes_state(self) -> bool:
        return self.effect in (Effect.WRITE, Effect.EXTERNAL)


def _cgroup_cpu_seconds(ws: Workspace) -> float:
    """CPU time charged to the workspace's cgroup (v1 ``cpuacct.usage`` in ns, v2 ``cpu.stat`` in us), or -1 when
    the cgroup has no CPU accounting (v1 hosts where workspaces do not join ``cpuacct``). Blocking."""
    cg = ws.cgroup
    if cg is None:
        return -1.0
    for d in cg.dirs:
        try:
            return int((d / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            pass
        try:
            for line in (d / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
    return -1.0


def _fork_cost(ws: Workspace) -> tuple[float, int]:
    """(CPU seconds, memory bytes: peak of the cgroup plus the private upper dir) of a fork. Blocking."""
    cg = ws.cgroup
    peak = (cg.memory_peak() or 0) if cg is not None else 0
    upper = ws.directory / "upper"
    return _cgroup_cpu_seconds(ws), peak + (tree_bytes(upper) if Path(upper).exists() else 0)


async def _fork_shielded(ws: Workspace) -> Workspace:
    """``(await ws.fork(1))[0]``, shielded from cancellation (a fork takes a few hundred ms; cancelling CRIU midway
    buys nothing), with a deadline."""
    with anyio.CancelScope(shield=True), anyio.fail_after(FORK_DEADLINE):
        copies = await ws.fork(1)
    return copies[0]


# `CMD | tail -n N` (or `tail -N`) where CMD is one simple command: no other pipe, list operator, background job,
# newline or output redirection anywhere in it (quoted or not: conservative), so that the pipeline prints CMD's
# stderr as it is and the last N lines of CMD's stdout, exits with tail's status (0: bash runs it without
# pipefail), and changes nothing CMD does not (tail reads all its input: CMD gets no SIGPIPE).
_TAIL = re.compile(r"^(?P<cmd>[^|;&\n>`]*[^|;&\n>`\s])\s*\|\s*tail\s+(?:-n\s*(?P<n>\d+)|-(?P<m>\d+))\s*$")


def _filtered(tool: Tool, key: CallKey) -> tuple[CallKey, int] | None:
    """For a shell call ``CMD | tail -n N`` (``_TAIL``): the key of plain ``CMD`` (other arguments equal) and N."""
    args = key.arguments()
    command = args.get("command")
    if not isinstance(command, str) or tool.name != "bash":
        return None
    m = _TAIL.match(command)
    if m is None:
        return None
    try:
        inner = CallKey.of(tool, {**args, "command": m.group("cmd")})
    except InvalidArgument:
        return None
    return inner, int(m.group("n") or m.group("m"))


def _tail_lines(text: str, n: int) -> str:
    """What ``tail -n n`` prints of ``text``: its last n lines (a last line without newline counts)."""
    lines = re.findall(r"[^\n]*\n|[^\n]+$", text)
    return "".join(lines[-n:]) if n > 0 else ""


def _apply_tail(result: Any, error: ToolError | None, n: int) -> ExecResult | None:
    """``CMD | tail -n n``'s result from ``CMD``'s, or None when it cannot be known exactly (an error, a timeout,
    output cut at the size limit, output that is not valid UTF-8 text)."""
    if error is not None or not isinstance(result, ExecResult) or result.truncated or "\ufffd" in result.stdout:
        return None
    return ExecResult(exit_code=0, stdout=_tail_lines(result.stdout, n), stderr=result.stderr,
                      duration=result.duration)  # fmt: skip


def _output_text(r: CallResult) -> str:
    if r.error is not None:
        return str(r.error)
    res = r.result
    if isinstance(res, ExecResult):
        return res.stdout + res.stderr
    return res if isinstance(res, str) else ""


def _outcome(result: Any, error: ToolError | None) -> Any:
    return error if error is not None else result


async def _run_tool(tool: Tool, ws: Workspace, args: dict[str, Any]) -> tuple[Any, ToolError | None]:
    if tool.handler is None:
        return None, ToolError(f"tool {tool.name!r} has no handler", tool=tool.name)
    try:
        return await tool.handler(ws, tool.normalize(args)), None
    except ToolError as exc:
        return None, exc


class SpeculativeTurn:
    """One turn of an agent loop. ``speculation=None`` is the plain path (calls run in order once the message has
    ended), with the same API and results, for differential comparison::

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
        self._clock = clock
        self._tg: TaskGroup | None = None
        self._out: MemoryObjectSendStream[TapEvent | CallResult] | None = None
        self._decided: list[_Decided] = []
        self._results: dict[int, CallResult] = {}
        self._branches: list[_Branch] = []
        self._all_branches: list[_Branch] = []
        self._predicted: set[CallKey] = set()
        self._finished: MessageFinished | None = None
        self._message_event = anyio.Event()
        self._complete = anyio.Event()
        self._usage: Usage | None = None
        self._writing = False
        self._t0 = clock()
        self._t_message = 0.0
        self._t_last = 0.0
        self.metrics = TurnMetrics(turn=handle.turns)
        self._fed = False
        self._last_position = -1

    # ------------------------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> SpeculativeTurn:
        self.handle.turns += 1
        self._t0 = self._clock()
        self._mark("turn_start")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        tg, self._tg = self._tg, None
        assert tg is not None
        if exc is not None or not self._complete.is_set():
            tg.cancel_scope.cancel()
        else:
            self._cancel_branches(lambda b: True)
        try:
            async with unwrap_group():
                await tg.__aexit__(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                await self._close_leftovers()
        return None

    async def _close_leftovers(self) -> None:
        for b in self._all_branches:
            if b.ws is not None and b.forked and not b.committed and not b.ws.closed:
                with anyio.move_on_after(CLOSE_DEADLINE):
                    await b.ws.aclose()

    def feed(self, events: AsyncIterable[TapEvent]) -> AsyncIterator[TapEvent | CallResult]:
        """Consume the tap's events; yields them through, interleaved with each ``CallResult`` as soon as it is
        ready. Call once per turn."""
        if self._tg is None:
            raise RuntimeError("use `async with SpeculativeTurn(...) as turn` before feeding it")
        if self._fed:
            raise RuntimeError("a turn is fed once")
        self._fed = True
        send, receive = anyio.create_memory_object_stream[TapEvent | CallResult](math.inf)
        self._out = send
        self._tg.start_soon(self._pump, events, send)
        return self._relay(receive)

    @staticmethod
    async def _relay(receive: Any) -> AsyncIterator[TapEvent | CallResult]:
        async with receive:
            async for item in receive:
                yield item

    async def results(self) -> TurnOutcome:
        """Wait until every call of the message has its result; the turn's outcome."""
        await self._complete.wait()
        assert self._finished is not None
        return TurnOutcome(
            message=self._finished,
            results=[self._results[d.call.index] for d in self._decided],
            usage=self._usage,
            metrics=self.metrics,
        )

    # ------------------------------------------------------------------------------------------ the stream

    async def _pump(self, events: AsyncIterable[TapEvent], send: MemoryObjectSendStream[TapEvent | CallResult]) -> None:
        async with send:
            self._replan()
            first = True
            async for ev in events:
                if first and isinstance(ev, TextDelta | ToolNameKnown):
                    self._mark("first_token")
                    first = False
                if isinstance(ev, ToolNameKnown):
                    self._mark("tool_name", ev.index, ev.name)
                    self._cancel_wrong_name(ev.index, ev.name)
                elif isinstance(ev, ArgumentsComplete):
                    self._mark("arguments_complete", ev.call.index, ev.call.name)
                    self._decide(ev.call)
                elif isinstance(ev, MessageFinished):
                    self._on_finished(ev)
                elif isinstance(ev, UsageReported):
                    self._usage = ev.usage
                self._emit(ev)
            self._mark("stream_end")
            if self._finished is None:  # the tap raises first; a hand-made event source might not
                raise BunshinError("the event stream ended before the message finished")
            for d in self._decided:
                await d.done.wait()
            self._cancel_branches(lambda b: True)
            for b in self._all_branches:
                await b.finished.wait()
            self._finalize()
            self._complete.set()

    def _emit(self, item: TapEvent | CallResult) -> None:
        if self._out is not None:
            try:
                self._out.send_nowait(item)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._out = None  # the caller stopped reading; the turn still completes

    def _on_finished(self, ev: MessageFinished) -> None:
        self._finished = ev
        self._t_message = self._clock()
        observe_llm = getattr(self.speculation.policy, "observe_llm", None) if self.speculation else None
        if observe_llm is not None:
            observe_llm(self._t_message - self._t0)
        self._mark("message_finished", len(ev.tool_calls), ev.finish_reason)
        known = {d.call.index for d in self._decided}
        for call in ev.tool_calls:
            if call.index not in known:
                self._decide(call)
        n = len(ev.tool_calls)
        self._cancel_branches(lambda b: b.position >= n)
        self._message_event.set()

    # ------------------------------------------------------------------------------------------ main line

    def _classify(self, name: str, args: Mapping[str, Any]) -> tuple[CallKey | None, Effect, bool]:
        tool = self.tools.get(name)
        if tool is None:
            return None, Effect.EXTERNAL, False
        try:
            key = CallKey.of(tool, args)
        except InvalidArgument:
            return None, Effect.EXTERNAL, False
        cls = tool.classify_call(key.arguments())
        return key, cls.effect, cls.deterministic

    def _context(self, position: int) -> PredictionContext:
        decided = tuple(d.key for d in self._decided[:position] if d.key is not None)
        return PredictionContext(
            history=tuple(self.handle.history),
            chain=self.handle.chain,
            turn=self.metrics.turn,
            position=position,
            decided=decided,
            group=self.speculation.group if self.speculation else "",
            last_output=self.handle.last_output,
        )

    def _decide(self, call: ToolCall) -> None:
        position = len(self._decided)
        key, effect, _ = self._classify(call.name, call.arguments)
        if key is not None:
            if self.speculation is not None:
                ctx = self._context(position)
                for predictor in self.speculation.predictors:
                    predictor.observe(ctx, key)
            self.handle.record(key)
        d = _Decided(call, position, key, effect, self._clock())
        self._decided.append(d)
        tool = self.tools.get(call.name)
        near = _filtered(tool, key) if tool is not None and key is not None else None
        wanted = {key, near[0] if near else None}
        self._cancel_branches(lambda b: b.position == position and b.key not in wanted)
        assert self._tg is not None
        self._tg.start_soon(self._run_call, d)
        self._replan()

    async def _run_call(self, d: _Decided) -> None:
        earlier = self._decided[: d.position]
        if d.changes_state:
            waits = earlier
        else:
            waits = [e for e in earlier if e.changes_state][-1:]
        for e in waits:
            await e.done.wait()
        if not self.early:
            await self._message_event.wait()
        t_due = self._clock()
        try:
            tool = lookup(self.tools, d.call.name)  # the model's error, as on the plain path: ends the turn
            branch = self._match(d) if d.key is not None else None
            if branch is not None:
                result = await self._use_branch(d, branch, t_due)
                if result is not None:
                    self._deliver(d, result)
                    return
            self._deliver(d, await self._execute(d, tool))
        finally:
            d.done.set()
            self._replan()

    def _match(self, d: _Decided) -> _Branch | None:
        """The branch started for exactly ``d``'s call, else (a near miss) one for the command ``d`` filters
        through ``| tail -n N`` (``_filtered``), whose output the filter is then applied to."""
        tool = self.tools.get(d.call.name)
        near = _filtered(tool, d.key) if tool is not None and d.key is not None else None
        keys = [d.key] if near is None else [d.key, near[0]]
        for want in keys:
            for b in self._branches:
                if b.key == want and b.epoch == self.handle.epoch and not b.discarded:
                    b.claimed = True
                    b.tail = near[1] if near and want != d.key else None
                    return b
        return None

    async def _use_branch(self, d: _Decided, b: _Branch, t_due: float) -> CallResult | None:
        try:
            await b.done.wait()
            t_ready = self._clock()
            if not b.ok or b.epoch != self.handle.epoch:
                return None
            if b.tail is not None:
                filtered = _apply_tail(b.result, b.error, b.tail)
                if filtered is None:  # not provably what the filtered command prints: run it instead
                    return None
                b.result = filtered
            assert d.key is not None
            if b.forked:
                assert b.ws is not None
                async with self.handle.lock:
                    self._cancel_branches(lambda other: other is not b)
                    await self._quiesce()
                    b.committed = True  # from here the fork is the handle's (or its executor's)
                    await self.handle.commit(b.ws, d.key, _outcome(b.result, b.error), b.run_end - b.run_start)
                    self.handle.advance()
            elif self.handle.executor is not None:  # a read: let the executor account it (a cache records it)
                assert b.ws is not None
                await self.handle.commit(b.ws, d.key, _outcome(b.result, b.error), b.run_end - b.run_start)
            now = self._clock()
            self._mark("branch_commit", d.position, f"{d.call.name} {b.launch.effect.value}")
            run = b.run_end - b.run_start
            # What the main line would have waited for without the branch, less what it waited for the branch;
            # the commit itself (the executor's bookkeeping, a cache capture) is not counted: a call run on the
            # main line pays for it too.
            b.used, b.saved = True, (t_due + run) - t_ready
            return CallResult(
                index=d.call.index, call=d.call, result=b.result, error=b.error, source="speculated", seconds=run, t=now
            )
        finally:
            if b in self._branches:
                self._branches.remove(b)
            b.released.set()

    async def _execute(self, d: _Decided, tool: Tool) -> CallResult:
        args = d.key.arguments() if d.key is not None else dict(d.call.arguments)
        if d.changes_state:
            async with self.handle.lock:
                self._writing = True
                try:
                    self._cancel_branches(lambda b: True)  # every branch saw the state this write changes
                    await self._quiesce()
                    ws = self.handle.workspace
                    self._mark("call_start", d.position, d.call.name)
                    t = self._clock()
                    result, error = await self._run_main(tool, ws, args)
                    seconds = self._clock() - t
                    self.handle.advance()
                finally:
                    self._writing = False
        else:
            ws = self.handle.workspace
            self._mark("call_start", d.position, d.call.name)
            t = self._clock()
            result, error = await self._run_main(tool, ws, args)
            seconds = self._clock() - t
        if self.speculation is not None and d.key is not None:
            self.speculation.policy.observe_tool(d.key, seconds)
        return CallResult(index=d.call.index, call=d.call, result=result, error=error, seconds=seconds, t=self._clock())

    async def _run_main(self, tool: Tool, ws: Workspace, args: dict[str, Any]) -> tuple[Any, ToolError | None]:
        executor = self.handle.executor
        if executor is None:
            return await _run_tool(tool, ws, args)
        try:
            return await executor.call(tool.name, args), None
        except ToolError as exc:
            return None, exc

    def _deliver(self, d: _Decided, result: CallResult) -> None:
        self._results[d.call.index] = result
        if d.position >= self._last_position:
            self._last_position = d.position
            self.handle.last_output = _output_text(result)
        self._t_last = max(self._t_last, result.t)
        self._mark("call_done", d.position, result.source)
        self._emit(result)

    async def _quiesce(self) -> None:
        """Wait until every branch that runs in the current workspace has stopped (they were cancelled)."""
        for b in list(self._all_branches):
            if not b.launch.needs_fork and not b.done.is_set():
                await b.done.wait()

    # ------------------------------------------------------------------------------------------ branches

    def _replan(self) -> None:
        """Ask the predictors about the next undecided call and launch what the policy picks. Only while the
        next call's starting state exists: the message is still streaming and no decided write is pending."""
        spec = self.speculation
        if spec is None or self._finished is not None or self._tg is None:
            return
        if self._writing or any(d.changes_state and not d.done.is_set() for d in self._decided):
            return
        position = len(self._decided)
        ctx = self._context(position)
        merged: dict[CallKey, tuple[Candidate, Launch]] = {}
        for predictor in spec.predictors:
            for cand in predictor.predict(ctx):
                key, effect, deterministic = self._classify(cand.name, cand.arguments)
                if key is None or effect is Effect.EXTERNAL or not deterministic:
                    continue
                self._predicted.add(key)
                prior = merged.get(key)
                if prior is None or cand.probability > prior[0].probability:
                    elapsed = self._clock() - self._t0
                    merged[key] = (cand, Launch(candidate=cand, key=key, effect=effect, turn_elapsed=elapsed))
        epoch = self.handle.epoch
        running = {b.key for b in self._branches if b.epoch == epoch}
        options = sorted(
            (
                launch
                for key, (_, launch) in merged.items()
                if key not in running and (spec.skip is None or not spec.skip(launch))
            ),
            key=lambda launch: -launch.candidate.probability,
        )
        if not options:
            return
        forks = sum(1 for b in self._branches if b.launch.needs_fork)
        for launch in spec.policy.select(options, running=len(self._branches), forks=forks):
            b = _Branch(launch, position, epoch, self._clock())
            self._branches.append(b)
            self._all_branches.append(b)
            self.metrics.launched += 1
            detail = f"{launch.key.name} {launch.effect.value} p={launch.candidate.probability:.2f}"
            self._mark("branch_launch", position, detail)
            self._tg.start_soon(self._run_branch, b)

    async def _run_branch(self, b: _Branch) -> None:
        tool = self.tools[b.key.name]
        args = b.key.arguments()
        try:
            with b.scope:
                if b.launch.needs_fork:
                    t = self._clock()
                    async with self.handle.lock:
                        if self.handle.epoch != b.epoch:
                            return
                        b.ws = await _fork_shielded(self.handle.workspace)
                    b.forked = True
                    await anyio.lowlevel.checkpoint()  # a cancellation that came during the fork lands here
                    b.fork_seconds = self._clock() - t
                    self._mark("branch_ready", b.position, f"fork {b.fork_seconds * 1000:.0f} ms")
                else:
                    if self._writing or self.handle.epoch != b.epoch:
                        return
                    b.ws = self.handle.workspace
                b.run_start = self._clock()
                b.result, b.error = await _run_tool(tool, b.ws, args)
                b.run_end = self._clock()
                b.ok = True
                self._mark("branch_done", b.position, b.key.name)
                b.done.set()
                await b.released.wait()  # until the main line took it, or the scope is cancelled
        except Exception as exc:  # a failed branch only costs its work: the call will run normally
            b.failed = True
            self._mark("branch_done", b.position, f"failed: {exc!r}"[:200])
        finally:
            b.done.set()
            with anyio.CancelScope(shield=True):
                await self._settle(b)
            b.finished.set()

    async def _settle(self, b: _Branch) -> None:
        """Account for a branch whose task ends, and close its fork unless it was committed."""
        if b in self._branches:
            self._branches.remove(b)
        spec = self.speculation
        if spec is not None:
            if b.ok:
                spec.policy.observe_tool(b.key, b.run_end - b.run_start)
        if b.forked and b.ws is not None and not b.committed:
            with anyio.move_on_after(CLOSE_DEADLINE):
                b.cpu_seconds, b.memory_bytes = await anyio.to_thread.run_sync(_fork_cost, b.ws)
            with anyio.move_on_after(CLOSE_DEADLINE):
                await b.ws.aclose()
        if spec is not None and b.forked:
            spec.policy.observe_fork(b.fork_seconds, b.memory_bytes)
        m = self.metrics
        if b.used:
            outcome: Literal["committed", "wasted", "failed"] = "committed"
            m.committed += 1
            m.saved_seconds += b.saved
        else:
            outcome = "failed" if b.failed else "wasted"
            end = b.run_end if b.run_end else self._clock()
            spent = b.fork_seconds + (end - b.run_start if b.run_start else 0.0)
            if b.cpu_seconds < 0 or not b.forked:
                b.cpu_seconds = spent  # no CPU accounting (or an in-place read): wall time, an upper bound
            m.wasted_seconds += spent
            m.wasted_cpu_seconds += b.cpu_seconds
            m.wasted_memory_bytes += b.memory_bytes
            if b.failed:
                m.failed += 1
            else:
                m.wasted += 1
            self._mark("branch_discard", b.position, b.key.name)
        m.fork_seconds += b.fork_seconds
        m.branches.append(
            BranchRecord(
                position=b.position,
                tool=b.key.name,
                effect=b.launch.effect.value,
                source=b.launch.candidate.source,
                probability=b.launch.candidate.probability,
                outcome=outcome,
                launched_at=b.launched_at - self._t0,
                fork_seconds=b.fork_seconds,
                run_seconds=(b.run_end - b.run_start) if b.run_end else 0.0,
                cpu_seconds=b.cpu_seconds,
                memory_bytes=b.memory_bytes,
                saved_seconds=b.saved,
            )
        )

    def _cancel_wrong_name(self, position: int, name: str) -> None:
        self._cancel_branches(lambda b: b.position == position and b.key.name != name)

    def _cancel_branches(self, which: Callable[[_Branch], bool]) -> None:
        for b in list(self._branches):
            if not b.claimed and which(b):
                self._branches.remove(b)
                b.discarded = True
                b.scope.cancel()

    # ------------------------------------------------------------------------------------------ metrics

    def _mark(self, kind: EventKind, index: int = -1, detail: str = "") -> None:
        self.metrics.timeline.append(TimelineEvent(self._clock() - self._t0, kind, index, detail))

    def _finalize(self) -> None:
        m = self.metrics
        end = max(self._t_last, self._t_message)
        m.calls = len(self._decided)
        m.predicted = len(self._predicted)
        m.llm_seconds = self._t_message - self._t0
        m.tool_seconds = max(0.0, end - self._t_message)
        m.turn_seconds = end - self._t0
        self._mark("turn_end")
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
        async for item in turn.feed(events):
            if on_result is not None and isinstance(item, CallResult):
                on_result(item)
        return await turn.results()
