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

import contextlib
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
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._exceptions import BunshinError, InvalidArgument, ToolError, unwrap_group
from .._host._protocol import ExecResult
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
from .._tools._tools import Effect, Tool, lookup
from .._workspace._accounting import tree_bytes, workspace_memory
from .._workspace._facade import Workspace
from ._calls import CallKey, Launch, Policy, PredictionContext, Predictor, extend_chain
from ._handle import CLOSE_DEADLINE, WorkspaceHandle
from ._metrics import BranchRecord, EventKind, RolloutMetrics, TimelineEvent, TurnMetrics, _Counts

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
    ``max_forks`` forks exist, if their probability is at least ``min_probability`` and they are at most
    ``max_depth`` speculated calls deep. ``speculator`` has the cost-aware one."""

    def __init__(
        self, max_branches: int = 2, max_forks: int = 1, min_probability: float = 0.0, max_depth: int = 1
    ) -> None:
        self.max_branches, self.max_forks, self.min_probability = max_branches, max_forks, min_probability
        self.max_depth = max_depth

    def select(self, options: Sequence[Launch], *, running: int, forks: int) -> list[Launch]:
        out: list[Launch] = []
        for option in options:
            if running >= self.max_branches:
                break
            if option.probability < self.min_probability or option.depth > self.max_depth:
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
    metrics) and ``turns`` keeps each turn's own metrics, in order.

    Chains: when a speculated write finishes in its fork before the model asked for it, the predictors are asked
    for the call after it (their context extended by that call and its output) and what the policy picks runs in
    a fork of that branch (a read in the branch's fork itself); committing a branch makes its children branches of
    the new state. ``keep``: inside ``handle.background()`` (``run_agent``), at most this many unused branches
    (their chains included) outlive their turn while no state change happened since they started: a later turn
    commits them when the model asks for their call; any committed write discards them. Their forks count against
    the policy's fork budget."""

    predictors: Sequence[Predictor] = ()
    policy: Policy = field(default_factory=BoundedPolicy)
    group: str = ""
    early: bool = True
    skip: Callable[[Launch], bool] | None = None
    keep: int = 2
    metrics: RolloutMetrics = field(default_factory=RolloutMetrics)
    turns: list[TurnMetrics] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ internals


class _Branch:
    """A speculative call. Its starting state is ``parent``'s fork after ``parent``'s call when it has a parent (a
    chain), else the handle's state at ``epoch``. ``turn`` is the turn that owns it now (a kept branch moves to the
    next turn)."""

    def __init__(
        self,
        launch: Launch,
        position: int,
        epoch: int,
        t: float,
        *,
        turn: SpeculativeTurn,
        ctx: PredictionContext,
        parent: _Branch | None = None,
    ) -> None:
        self.launch = launch
        self.turn = turn
        self.ctx = ctx
        self.parent = parent
        self.children: list[_Branch] = []
        self.depth = launch.depth
        self.kept = False
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
        self.started = False  # its task began (a task cancelled before it starts holds nothing)
        self.lock = anyio.Lock()  # held while a chained child forks this branch's fork, and while it is committed


def _descends(b: _Branch, ancestor: _Branch) -> bool:
    p = b.parent
    while p is not None:
        if p is ancestor:
            return True
        p = p.parent
    return False


def _merge_counts(dst: _Counts, src: _Counts) -> None:
    for name in _Counts.__struct_fields__:
        setattr(dst, name, getattr(dst, name) + getattr(src, name))


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


def _active(spec: Speculation) -> bool:
    """The policy wants launches considered now (``Policy.active``, where it has one)."""
    active = getattr(spec.policy, "active", None)
    return active is None or bool(active())


def _cgroup_cpu_seconds(ws: Workspace) -> float:
    """CPU time charged to the workspace's cgroup, or -1 without CPU accounting. Blocking."""
    cg = ws.cgroup
    seconds = cg.cpu_seconds() if cg is not None else None
    return -1.0 if seconds is None else seconds


def _fork_cost(ws: Workspace) -> tuple[float, int]:
    """(CPU seconds, memory bytes: peak of the cgroup plus the private upper dir) of a fork. Blocking."""
    cg = ws.cgroup
    peak = (cg.memory_peak() or 0) if cg is not None else 0
    return _cgroup_cpu_seconds(ws), peak + _upper_bytes(ws)


def _upper_bytes(ws: Workspace) -> int:
    """The bytes of ``ws``'s private upper dir (what it wrote). Blocking."""
    upper = Path(ws.directory / "upper")
    return tree_bytes(upper) if upper.exists() else 0


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
    return _text(r.result, r.error)


def _text(res: Any, error: ToolError | None) -> str:
    if error is not None:
        return str(error)
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
        self._in: MemoryObjectReceiveStream[TapEvent | CallResult] | None = None
        self._on_result: Callable[[CallResult], object] | None = None
        self._decided: list[_Decided] = []
        self._results: dict[int, CallResult] = {}
        self._branches: list[_Branch] = []
        self._all_branches: list[_Branch] = []
        self._predicted: set[CallKey] = set()
        # What each predictor proposed for the next undecided call (source -> key -> probability), scored when that
        # call is decided: a policy learns its predictors' precision from every guess, launched or not.
        self._proposed: dict[int, dict[str, dict[CallKey, float]]] = {}
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
        self._finalized = False
        self._closing = False  # the turn is ending: no new branch (a chain launched now would never be waited for)

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def _keeping(self) -> bool:
        """Branches may outlive this turn (``Speculation.keep`` inside ``handle.background()``)."""
        return self.speculation is not None and self.speculation.keep > 0 and self.handle.tasks is not None

    async def __aenter__(self) -> SpeculativeTurn:
        self.handle.turns += 1
        self._t0 = self._clock()
        self._mark("turn_start")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        kept, self.handle.kept = self.handle.kept, []
        for b in kept:  # the previous turn's unused branches: still valid (no state change since), now ours
            b.turn, b.kept = self, False
            self._branches.append(b)
            self._all_branches.append(b)
            self._mark("branch_kept", b.position, b.key.name)
        if not self._keeping:
            self._cancel_branches(lambda b: True)
        for b in kept:  # a write that finished after its turn ended has not chained yet
            if b.ok and b.launch.needs_fork and not b.children and not b.discarded:
                self._chain(b)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        tg, self._tg = self._tg, None
        assert tg is not None
        self._closing = True
        failed = exc is not None or not self._complete.is_set()
        if failed:
            tg.cancel_scope.cancel()
            for b in list(self.handle.kept):
                if b.turn is self:
                    self._discard(b)
            self._cancel_branches(lambda b: True)
        else:
            self._cancel_branches(lambda b: not b.kept)
        try:
            async with unwrap_group():
                await tg.__aexit__(exc_type, exc, tb)
        finally:
            for stream in (self._out, self._in):  # the pump or the relay may never have started to close them
                if stream is not None:
                    stream.close()
            with anyio.CancelScope(shield=True):
                if failed:  # branches running in the handle's task group close their own forks: wait for them
                    for b in self._all_branches:
                        if b.turn is self and b.started:
                            with anyio.move_on_after(FORK_DEADLINE + CLOSE_DEADLINE):
                                await b.finished.wait()
                await self._close_leftovers()
        return None

    async def _close_leftovers(self) -> None:
        for b in self._all_branches:
            if b.turn is not self or b.kept:
                continue
            if b.ws is not None and b.forked and not b.committed and not b.ws.closed:
                with anyio.move_on_after(CLOSE_DEADLINE):
                    await b.ws.aclose()

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
        self._on_result = on_result
        await self._pump(events, None)
        return await self.results()

    def _start_feed(self) -> None:
        if self._tg is None:
            raise RuntimeError("use `async with SpeculativeTurn(...) as turn` before feeding it")
        if self._fed:
            raise RuntimeError("a turn is fed once")
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
            results=[self._results[d.call.index] for d in self._decided],
            usage=self._usage,
            metrics=self.metrics,
        )

    # ------------------------------------------------------------------------------------------ the stream

    async def _pump(
        self, events: AsyncIterable[TapEvent], send: MemoryObjectSendStream[TapEvent | CallResult] | None
    ) -> None:
        async with send if send is not None else contextlib.nullcontext():
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
            self._closing = True
            keep = self._handover()
            self._cancel_branches(lambda b: b not in keep)
            for b in self._all_branches:
                if b.turn is self and b not in keep:
                    await b.finished.wait()
            for b in keep:
                b.kept = True
                if b in self._branches:
                    self._branches.remove(b)
            self.handle.kept = keep
            self._finalize()
            self._complete.set()

    def _valid(self, b: _Branch) -> bool:
        """``b``'s starting state still exists: its parent's branch is alive, or no state change happened since."""
        while b.parent is not None:
            if b.parent.discarded or b.parent.failed:
                return False
            b = b.parent
        return b.epoch == self.handle.epoch and not b.discarded

    def _handover(self) -> list[_Branch]:
        """The unused branches this turn hands to the next (``Speculation.keep`` of them, chains with their
        parents): finished ones first, then the likeliest."""
        if not self._keeping:
            return []
        assert self.speculation is not None
        alive = [b for b in self._branches if not b.claimed and not b.discarded and not b.failed and self._valid(b)]
        alive.sort(key=lambda b: (not b.done.is_set(), -b.launch.probability))
        keep: list[_Branch] = []
        for b in alive:
            chain = [b]
            while chain[-1].parent is not None:
                chain.append(chain[-1].parent)
            new = [c for c in chain if c not in keep]
            if len(keep) + len(new) <= self.speculation.keep:
                keep.extend(reversed(new))
        return keep

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
        if not self._keeping:
            self._cancel_branches(lambda b: b.position >= n)
        self._message_event.set()

    # ------------------------------------------------------------------------------------------ main line

    def _key(self, name: str, args: Mapping[str, Any]) -> CallKey | None:
        tool = self.tools.get(name)
        if tool is None:
            return None
        try:
            return CallKey.of(tool, args)
        except InvalidArgument:
            return None

    def _classify(self, name: str, args: Mapping[str, Any]) -> tuple[CallKey | None, Effect, bool]:
        key = self._key(name, args)
        if key is None:
            return None, Effect.EXTERNAL, False
        cls = self.tools[name].classify_call(key.arguments())
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
        if self.speculation is not None and not _active(self.speculation):
            # Paused: nothing will be speculated, so the call's effect class (a parse of its command) buys nothing;
            # run it as a write, in the plain loop's order, making any branch still alive stale.
            key, effect = self._key(call.name, call.arguments), Effect.WRITE
        else:
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
        self._score(position, wanted)
        # A finished branch for another call may stay (its state is unchanged until a write: a later call may want
        # it, and it costs only memory); one still running for another call goes (it takes CPU from the rollouts).
        keep_done = self._keeping
        self._cancel_branches(
            lambda b: b.position == position and b.key not in wanted and not (keep_done and b.done.is_set())
        )
        assert self._tg is not None
        self._tg.start_soon(self._run_call, d)
        self._replan()

    def _score(self, position: int, wanted: set[CallKey | None]) -> None:
        """Tell the policy (if it learns precision: ``observe_prediction``) how each predictor's guesses for call
        ``position`` fared: one report per source, its guesses' summed probability and whether one was a call a
        branch could serve (``wanted``: the call, or the command it filters)."""
        proposed = self._proposed.pop(position, {})
        observe = getattr(self.speculation.policy, "observe_prediction", None) if self.speculation else None
        if observe is None:
            return
        for source, guesses in proposed.items():
            observe(source, min(1.0, sum(guesses.values())), any(k in guesses for k in wanted if k is not None))

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
                if b.key == want and b.parent is None and b.epoch == self.handle.epoch and not b.discarded:
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
            skip = self.speculation.skip if self.speculation is not None else None
            if b.launch.depth > 0 and skip is not None and skip(b.launch):
                return None  # a chained call the cache now serves (its veto could not judge the chain's state)
            if b.tail is not None:
                filtered = _apply_tail(b.result, b.error, b.tail)
                if filtered is None:  # not provably what the filtered command prints: run it instead
                    return None
                b.result = filtered
            assert d.key is not None
            if b.forked:
                assert b.ws is not None
                async with self.handle.lock, b.lock:
                    # Every branch but b's own chain saw a state b changes; b's children started from b's state.
                    self._cancel_branches(lambda other: other is not b and not _descends(other, b))
                    await self._quiesce()
                    b.committed = True  # from here the fork is the handle's (or its executor's)
                    await self.handle.commit(b.ws, d.key, _outcome(b.result, b.error), b.run_end - b.run_start)
                    self.handle.advance()
                    for child in b.children:  # now branches of the committed state
                        child.parent, child.epoch = None, self.handle.epoch
                    b.children = []
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
                    result, error, seconds = await self._run_main(tool, ws, args, d.key)
                    self.handle.advance()
                finally:
                    self._writing = False
        else:
            ws = self.handle.workspace
            self._mark("call_start", d.position, d.call.name)
            result, error, seconds = await self._run_main(tool, ws, args, d.key)
        return CallResult(index=d.call.index, call=d.call, result=result, error=error, seconds=seconds, t=self._clock())

    async def _run_main(
        self, tool: Tool, ws: Workspace, args: dict[str, Any], key: CallKey | None
    ) -> tuple[Any, ToolError | None, float]:
        """Run a decided call on the main line: (result, error, seconds). The policy is told its run time and, with
        ``observe_cpu``, the CPU it took (the workspace's cgroup, read in place: a few bytes of sysfs, cheaper than a
        thread hop)."""
        policy = self.speculation.policy if self.speculation is not None and key is not None else None
        observe_cpu = getattr(policy, "observe_cpu", None)
        before = _cgroup_cpu_seconds(ws) if observe_cpu is not None else -1.0
        t = self._clock()
        executor = self.handle.executor
        if executor is None:
            result, error = await _run_tool(tool, ws, args)
        else:
            try:
                result, error = await executor.call(tool.name, args), None
            except ToolError as exc:
                result, error = None, exc
        seconds = self._clock() - t
        if policy is not None and key is not None:
            policy.observe_tool(key, seconds)
            if observe_cpu is not None and before >= 0 and (after := _cgroup_cpu_seconds(ws)) >= 0:
                observe_cpu(key, after - before, seconds)
        return result, error, seconds

    def _deliver(self, d: _Decided, result: CallResult) -> None:
        self._results[d.call.index] = result
        if d.position >= self._last_position:
            self._last_position = d.position
            self.handle.last_output = _output_text(result)
        self._t_last = max(self._t_last, result.t)
        self._mark("call_done", d.position, result.source)
        if self._on_result is not None:
            self._on_result(result)
        self._emit(result)

    async def _quiesce(self) -> None:
        """Wait until every branch that runs in the current workspace has stopped (they were cancelled)."""
        for b in list(self._all_branches):
            if not b.launch.needs_fork and b.parent is None and not b.done.is_set():
                await b.done.wait()

    # ------------------------------------------------------------------------------------------ branches

    def _replan(self) -> None:
        """Ask the predictors about the next undecided call and launch what the policy picks. Only while the
        next call's starting state exists: the message is still streaming and no decided write is pending."""
        spec = self.speculation
        if spec is None or self._finished is not None or self._tg is None or self._closing:
            return
        if self._writing or any(d.changes_state and not d.done.is_set() for d in self._decided):
            return
        if not _active(spec):
            self.metrics.paused += 1
            return
        position = len(self._decided)
        ctx = self._context(position)
        epoch = self.handle.epoch
        running = {b.key for b in self._branches if b.parent is None and b.epoch == epoch}
        running |= {d.key for d in self._decided if d.key is not None and not d.done.is_set()}  # runs anyway
        options = self._options(ctx, exclude=running)
        if not options:
            return
        for launch in spec.policy.select(options, running=self._running(), forks=self._forks()):
            self._launch(_Branch(launch, position, epoch, self._clock(), turn=self, ctx=ctx))

    def _options(self, ctx: PredictionContext, *, exclude: set[CallKey], parent: Launch | None = None) -> list[Launch]:
        """The predictors' candidates for ``ctx`` as launches, deduplicated (highest probability kept), best first,
        without ``exclude``'s and (for the next call itself) what ``Speculation.skip`` vetoes."""
        spec = self.speculation
        assert spec is not None
        merged: dict[CallKey, Launch] = {}
        elapsed = self._clock() - self._t0
        depth, prior = (0, 1.0) if parent is None else (parent.depth + 1, parent.probability)
        for predictor in spec.predictors:
            for cand in predictor.predict(ctx):
                key, effect, deterministic = self._classify(cand.name, cand.arguments)
                if key is None or effect is Effect.EXTERNAL or not deterministic:
                    continue
                self._predicted.add(key)
                if depth == 0:
                    guesses = self._proposed.setdefault(ctx.position, {}).setdefault(cand.source, {})
                    guesses[key] = cand.probability
                prior_launch = merged.get(key)
                if prior_launch is None or cand.probability > prior_launch.candidate.probability:
                    merged[key] = Launch(
                        candidate=cand, key=key, effect=effect, turn_elapsed=elapsed, depth=depth, prior=prior,
                        rollout=self.handle.name, progress=len(ctx.history), parent=parent,
                    )  # fmt: skip
        skip = spec.skip if depth == 0 else None  # a veto (the cache's) judges the current state, not a chain's
        return sorted(
            (o for k, o in merged.items() if k not in exclude and (skip is None or not skip(o))),
            key=lambda o: -o.probability,
        )

    def _running(self) -> int:
        return sum(1 for b in self._branches if not b.done.is_set())

    def _forks(self) -> int:
        return sum(1 for b in self._branches if b.launch.needs_fork)

    def _launch(self, b: _Branch) -> None:
        assert not self._closing
        self._branches.append(b)
        self._all_branches.append(b)
        self.metrics.launched += 1
        launch = b.launch
        chained = f" after {b.parent.key.name}" if b.parent is not None else ""
        detail = f"{launch.key.name} {launch.effect.value} p={launch.probability:.2f}{chained}"
        self._mark("branch_launch", b.position, detail)
        tg = self.handle.tasks if self._keeping else self._tg
        assert tg is not None
        tg.start_soon(self._run_branch, b)

    def _chain(self, b: _Branch) -> None:
        """``b`` (a write) finished before the model asked for it: launch what the policy picks of the calls
        predicted to follow it, in forks of ``b``'s fork (reads in ``b``'s fork itself)."""
        spec = self.speculation
        if spec is None or self._closing or self._tg is None or b.discarded or b.claimed:
            return
        ctx = b.ctx
        if not self._keeping and self._finished is not None and ctx.position + 1 >= len(self._finished.tool_calls):
            return  # the message has no call after b's: without kept branches the child would be discarded
        if not _active(spec):
            return
        after = PredictionContext(
            history=(*ctx.history, b.key),
            chain=extend_chain(ctx.chain, b.key),
            turn=ctx.turn,
            position=ctx.position + 1,
            decided=(*ctx.decided, b.key),
            group=ctx.group,
            last_output=_text(b.result, b.error),
        )
        exclude = {c.key for c in b.children}
        options = self._options(after, exclude=exclude, parent=b.launch)
        if not options:
            return
        for launch in spec.policy.select(options, running=self._running(), forks=self._forks()):
            child = _Branch(launch, after.position, b.epoch, self._clock(), turn=self, ctx=after, parent=b)
            b.children.append(child)
            self._launch(child)

    def _base(self, b: _Branch) -> Workspace | None:
        """Where ``b`` starts: its parent's fork, or the current workspace if its state is still the current one;
        None when that state is gone (``b`` then does nothing)."""
        if b.discarded:
            return None
        p = b.parent
        if p is None:
            return self.handle.workspace if self.handle.epoch == b.epoch else None
        if not p.ok or p.discarded or p.ws is None or p.ws.closed:
            return None
        return p.ws

    async def _run_branch(self, b: _Branch) -> None:
        """The branch's task; ``b.turn`` (not ``self``) is the turn that owns it now: a kept branch moves on."""
        b.started = True
        tool = self.tools[b.key.name]
        args = b.key.arguments()
        try:
            with b.scope:
                if b.launch.needs_fork:
                    t = self._clock()
                    while b.ws is None:
                        # A chained branch forks its parent's fork under the parent's lock (held while the parent
                        # is committed), so it does not hold up the main line; if the parent was committed in the
                        # meantime, the branch now starts from the current workspace: take the handle's lock.
                        parent = b.parent
                        async with parent.lock if parent is not None else self.handle.lock:
                            if b.parent is not parent:
                                continue
                            base = self._base(b)
                            if base is None:
                                return
                            b.ws = await _fork_shielded(base)
                    b.forked = True
                    b.fork_seconds = self._clock() - t
                    await anyio.lowlevel.checkpoint()  # a cancellation that came during the fork lands here
                    b.turn._mark("branch_ready", b.position, f"fork {b.fork_seconds * 1000:.0f} ms")
                else:
                    base = self._base(b)
                    if base is None or (b.parent is None and b.turn._writing):
                        return
                    b.ws = base
                b.run_start = self._clock()
                b.result, b.error = await _run_tool(tool, b.ws, args)
                b.run_end = self._clock()
                b.ok = True
                b.turn._mark("branch_done", b.position, b.key.name)
                b.done.set()
                if b.launch.needs_fork:
                    b.turn._chain(b)
                await b.released.wait()  # until the main line took it, or the scope is cancelled
        except Exception as exc:  # a failed branch only costs its work: the call will run normally
            b.failed = True
            b.turn._mark("branch_done", b.position, f"failed: {exc!r}"[:200])
        finally:
            b.done.set()
            with anyio.CancelScope(shield=True):
                await self._settle(b)
            b.finished.set()

    async def _settle(self, b: _Branch) -> None:
        """Account for a branch whose task ends, and close its fork unless it was committed."""
        owner = b.turn
        if b in owner._branches:
            owner._branches.remove(b)
        if b in self.handle.kept:
            self.handle.kept.remove(b)
        if not b.committed and b.children:  # they start from this fork: stop them before it closes
            for c in list(b.children):
                self._discard(c)
            for c in list(b.children):
                if c.started:
                    with anyio.move_on_after(FORK_DEADLINE + CLOSE_DEADLINE):
                        await c.done.wait()
        spec = owner.speculation
        if spec is not None:
            if b.ok:
                spec.policy.observe_tool(b.key, b.run_end - b.run_start)
        observe_rollout = getattr(spec.policy, "observe_rollout_memory", None) if spec is not None else None
        rollout_bytes = 0
        if b.forked and b.ws is not None and not b.committed:
            fork, rollout = b.ws, (self.handle.workspace if observe_rollout is not None else None)

            def measure() -> tuple[tuple[float, int], int]:  # the rollout at the same moment
                return _fork_cost(fork), (workspace_memory(rollout) if rollout is not None else 0)

            with anyio.move_on_after(CLOSE_DEADLINE):
                (b.cpu_seconds, b.memory_bytes), rollout_bytes = await anyio.to_thread.run_sync(measure)
            with anyio.move_on_after(CLOSE_DEADLINE):
                await b.ws.aclose()
        if spec is not None:
            if b.forked:
                spec.policy.observe_fork(b.fork_seconds, b.memory_bytes)
                if observe_rollout is not None and b.memory_bytes and rollout_bytes:
                    observe_rollout(rollout_bytes)
            release = getattr(spec.policy, "release", None)
            if release is not None:
                release(b.launch, b.used)
        m = TurnMetrics(turn=owner.metrics.turn)
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
            owner._mark("branch_discard", b.position, b.key.name)
        m.fork_seconds += b.fork_seconds
        _merge_counts(owner.metrics, m)
        if owner._finalized:  # a kept branch ended after its last turn (the rollout ended): count it still
            _merge_counts(self.handle.metrics, m)
            if spec is not None:
                _merge_counts(spec.metrics, m)
        owner.metrics.branches.append(
            BranchRecord(
                position=b.position,
                tool=b.key.name,
                effect=b.launch.effect.value,
                source=b.launch.candidate.source,
                probability=b.launch.probability,
                outcome=outcome,
                launched_at=b.launched_at - owner._t0,
                fork_seconds=b.fork_seconds,
                run_seconds=(b.run_end - b.run_start) if b.run_end else 0.0,
                cpu_seconds=b.cpu_seconds,
                memory_bytes=b.memory_bytes,
                saved_seconds=b.saved,
                depth=b.depth,
            )
        )

    def _cancel_wrong_name(self, position: int, name: str) -> None:
        keep_done = self._keeping
        self._cancel_branches(
            lambda b: b.position == position and b.key.name != name and not (keep_done and b.done.is_set())
        )

    def _cancel_branches(self, which: Callable[[_Branch], bool]) -> None:
        for b in list(self._branches):
            if not b.claimed and not b.discarded and which(b):
                self._discard(b)

    def _discard(self, b: _Branch) -> None:
        """Cancel ``b`` and every branch chained after it (they start from its state)."""
        stack = [b]
        while stack:
            c = stack.pop()
            if c.claimed or c.discarded:
                continue
            c.discarded = True
            if c in c.turn._branches:
                c.turn._branches.remove(c)
            if c in self.handle.kept:
                self.handle.kept.remove(c)
            c.scope.cancel()
            stack.extend(c.children)

    # ------------------------------------------------------------------------------------------ metrics

    def _mark(self, kind: EventKind, index: int = -1, detail: str = "") -> None:
        self.metrics.timeline.append(TimelineEvent(self._clock() - self._t0, kind, index, detail))

    def _finalize(self) -> None:
        self._finalized = True
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
        return await turn.consume(events, on_result)
