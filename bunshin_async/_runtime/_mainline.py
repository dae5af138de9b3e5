"""The main line: the calls the model decided, run in the plain agent loop's order, each taking the branch started
for it when one exists (committing a write branch's fork as the rollout's workspace), else running in the current
workspace (through the handle's ``Executor`` when it has one, so a tool cache can serve it).

A read/pure call waits for the previous write of the message, a write/external call for every previous call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from .._exceptions import ToolError, WorkspaceError
from .._llm._events import ToolCall
from .._tools._tools import Effect, Tool, lookup
from .._workspace._facade import Workspace
from ._branches import Branch, BranchSet, descends, run_tool
from ._calls import CallKey
from ._handle import WorkspaceHandle
from ._metrics import TurnLog
from ._nearmiss import apply_tail, filtered, outcome, outcome_text
from ._probes import cgroup_cpu_seconds
from ._results import CallResult
from ._speculation import Speculation
from ._telling import Ran, tell_run

__all__ = ["Decided", "MainLine"]


class Decided:
    """A call the model made: its place in the message (``position``), canonical ``key`` (None: unknown tool or
    invalid arguments, which the run reports), ``effect`` class and the time it was decided."""

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


class MainLine:
    """Runs a turn's decided calls. ``early``: a call may start before the message ends (else it waits for
    ``message``). ``emit`` passes each ``CallResult`` on, ``on_result`` (optional) is told it too, ``after`` runs
    when a call is done (the turn plans its next launches)."""

    def __init__(
        self,
        handle: WorkspaceHandle,
        tools: dict[str, Tool],
        speculation: Speculation | None,
        branches: BranchSet,
        log: TurnLog,
        *,
        early: bool,
        emit: Callable[[CallResult], None],
        after: Callable[[], None],
    ) -> None:
        self.handle, self.tools, self.speculation = handle, tools, speculation
        self.branches, self.log, self.early = branches, log, early
        self.emit, self.after = emit, after
        self.on_result: Callable[[CallResult], object] | None = None
        self.decided: list[Decided] = []
        self.results: dict[int, CallResult] = {}
        self.message = anyio.Event()  # the message has ended (every call is decided)
        self.t_last = 0.0
        self._last_position = -1

    @property
    def write_pending(self) -> bool:
        """A decided write has not finished: the next call's starting state does not exist yet."""
        return any(d.changes_state and not d.done.is_set() for d in self.decided)

    def start(self, d: Decided, tg: TaskGroup) -> None:
        self.decided.append(d)
        tg.start_soon(self._run_call, d)

    async def _run_call(self, d: Decided) -> None:
        earlier = self.decided[: d.position]
        if d.changes_state:
            waits = earlier
        else:
            waits = [e for e in earlier if e.changes_state][-1:]
        for e in waits:
            await e.done.wait()
        if not self.early:
            await self.message.wait()
        t_due = self.log.clock()
        try:
            tool = lookup(self.tools, d.call.name)  # the model's error, as on the plain path: ends the turn
            branch = self._match(d) if d.key is not None else None
            if branch is not None:
                result = await self._use_branch(d, branch, t_due)
                if result is not None:
                    self._deliver(d, result)
                    return
                if branch.pids is not None:  # the call runs here after all: the read's pids go back first
                    branch.pids.used = False
            self._deliver(d, await self._execute(d, tool))
        finally:
            d.done.set()
            self.after()

    def _match(self, d: Decided) -> Branch | None:
        """The branch started for exactly ``d``'s call, else (a near miss) one for the command ``d`` filters
        through ``| tail -n N`` (``filtered``), whose output the filter is then applied to."""
        tool = self.tools.get(d.call.name)
        near = filtered(tool, d.key) if tool is not None and d.key is not None else None
        keys = [d.key] if near is None else [d.key, near[0]]
        for want in keys:
            for b in self.branches.live:
                if b.key == want and b.parent is None and b.epoch == self.handle.epoch and not b.discarded:
                    b.claimed = True
                    b.tail = near[1] if near and want != d.key else None
                    return b
        return None

    async def _use_branch(self, d: Decided, b: Branch, t_due: float) -> CallResult | None:
        try:
            moved: float | None = None
            if b.launch.needs_fork and b.launch.depth == 0 and b.tail is None and self.handle.can_move:
                await b.calling.wait()  # a fork that fails before its call starts leaves the workspace as it was
                if not b.done.is_set() and b.epoch == self.handle.epoch:
                    moved = await self._move(d, b)
            if moved is not None:
                return self._taken(d, b, t_due, moved)
            await b.done.wait()
            t_ready = self.log.clock()
            if not b.ok or b.epoch != self.handle.epoch:
                return None
            skip = self.speculation.skip if self.speculation is not None else None
            if b.launch.depth > 0 and skip is not None and skip(b.launch):
                return None  # a chained call the cache now serves (its veto could not judge the chain's state)
            if b.tail is not None:
                tailed = apply_tail(b.result, b.error, b.tail)
                if tailed is None:  # not provably what the filtered command prints: run it instead
                    return None
                b.result = tailed
            assert d.key is not None
            if b.forked:
                assert b.ws is not None
                async with self.handle.lock, b.lock:
                    # Every branch but b's own chain saw a state b changes; b's children started from b's state.
                    self.branches.cancel(lambda other: other is not b and not descends(other, b))
                    await self.branches.quiesce()
                    b.committed = True  # from here the fork is the handle's (or its executor's)
                    await self.handle.commit(b.ws, d.key, outcome(b.result, b.error), b.run_end - b.run_start)
                    self.handle.advance()
                    for child in b.children:  # now branches of the committed state
                        child.parent, child.epoch = None, self.handle.epoch
                    b.children = []
            elif self.handle.executor is not None:  # a read: let the executor account it (a cache records it)
                assert b.ws is not None
                await self.handle.commit(b.ws, d.key, outcome(b.result, b.error), b.run_end - b.run_start)
            return self._taken(d, b, t_due, t_ready)
        finally:
            if b in self.branches.live:
                self.branches.live.remove(b)
            b.released.set()

    async def _move(self, d: Decided, b: Branch) -> float | None:
        """Commit write branch ``b`` while its call still runs: the rollout moves into its fork now and its previous
        workspace is closed (a hit holds two workspaces only until the model asks for the call, not until the call
        ends); the call is recorded once it ends (``handle.commit``). From the move on the fork is the rollout's
        workspace: if its call then dies of anything but a ``ToolError`` (the workspace failed), that is raised, as
        a main-line call in a failing workspace raises it. Returns when the result was ready (the move made and
        the call ended; the commit, which a main-line call pays alike, after it); None: ``b`` ended first (its
        result is used, or the call runs here, as before)."""
        assert d.key is not None and b.ws is not None
        async with self.handle.lock, b.lock:
            if b.done.is_set():  # (while this waited for the locks)
                return None
            self.branches.writing = True  # nothing may start from the state in between (the planner waits too)
            try:
                self.branches.cancel(lambda other: other is not b and not descends(other, b))
                await self.branches.quiesce()
                b.committed = True  # from here the fork is the handle's (or its executor's)
                await self.handle.move(b.ws)
                self.log.mark("branch_move", d.position, d.call.name)
                await b.done.wait()
                if not b.ok:
                    if b.exc is not None:
                        raise b.exc
                    raise WorkspaceError(
                        f"the workspace ended while running {d.call.name} (a committed branch)", workspace_id=b.ws.id
                    )
                ready = self.log.clock()
                await self.handle.commit(b.ws, d.key, outcome(b.result, b.error), b.run_end - b.run_start)
                self.handle.advance()
                for child in b.children:  # (none: a branch chains only once it finished unclaimed)
                    child.parent, child.epoch = None, self.handle.epoch
                b.children = []
            finally:
                self.branches.writing = False
        return ready

    def _taken(self, d: Decided, b: Branch, t_due: float, t_ready: float) -> CallResult:
        """``b``'s result, used for ``d``."""
        now = self.log.clock()
        self.log.mark("branch_commit", d.position, f"{d.call.name} {b.launch.effect.value}")
        run = b.run_end - b.run_start
        # What the main line would have waited for without the branch, less what it waited for the branch; the
        # commit itself (the executor's bookkeeping, a cache capture) is not counted: a call run on the main line
        # pays for it too.
        b.used, b.saved = True, (t_due + run) - t_ready
        if b.pids is not None and not b.pids.decided:
            b.pids.use(ran=b.ran)
        return CallResult(
            index=d.call.index, call=d.call, result=b.result, error=b.error, source="speculated", seconds=run, t=now
        )

    async def _execute(self, d: Decided, tool: Tool) -> CallResult:
        args = d.key.arguments() if d.key is not None else dict(d.call.arguments)
        if d.changes_state:
            async with self.handle.lock:
                self.branches.writing = True
                try:
                    self.branches.cancel(lambda b: True)  # every branch saw the state this write changes
                    await self.branches.quiesce()
                    ws = self.handle.workspace
                    self.log.mark("call_start", d.position, d.call.name)
                    result, error, seconds = await self._run_main(tool, ws, args, d.key)
                    self.handle.advance()
                finally:
                    self.branches.writing = False
        else:
            ws = self.handle.workspace
            self.log.mark("call_start", d.position, d.call.name)
            result, error, seconds = await self._run_main(tool, ws, args, d.key)
        return CallResult(
            index=d.call.index, call=d.call, result=result, error=error, seconds=seconds, t=self.log.clock()
        )

    async def _run_main(
        self, tool: Tool, ws: Workspace, args: dict[str, Any], key: CallKey | None
    ) -> tuple[Any, ToolError | None, float]:
        """Run a decided call on the main line, or let the executor serve it (a tool cache's restore, or its wait
        for an identical call in flight): (result, error, seconds). The policy is told those seconds (``tell_run``)
        and, with ``observe_cpu``, the CPU it took (the workspace's cgroup, read in place: a few bytes of sysfs,
        cheaper than a thread hop)."""
        policy = self.speculation.policy if self.speculation is not None and key is not None else None
        observe_cpu = getattr(policy, "observe_cpu", None)
        before = cgroup_cpu_seconds(ws) if observe_cpu is not None else -1.0
        t = self.log.clock()
        executor = self.handle.executor
        if executor is None:
            result, error = await run_tool(tool, ws, args)
        else:
            try:
                result, error = await executor.call(tool.name, args), None
            except ToolError as exc:
                result, error = None, exc
        seconds = self.log.clock() - t
        if policy is not None and key is not None:
            after = cgroup_cpu_seconds(ws) if observe_cpu is not None and before >= 0 else -1.0
            tell_run(policy, key, seconds, Ran.MAIN, cpu_seconds=after - before if after >= 0 else -1.0)
        return result, error, seconds

    def _deliver(self, d: Decided, result: CallResult) -> None:
        self.results[d.call.index] = result
        if d.position >= self._last_position:
            self._last_position = d.position
            self.handle.last_output = outcome_text(result.result, result.error)
        self.t_last = max(self.t_last, result.t)
        self.log.mark("call_done", d.position, result.source)
        if self.on_result is not None:
            self.on_result(result)
        self.emit(result)
