"""Speculative branches: a ``Branch`` runs one predicted call (a write in a fork of its starting state, a read in
place), and the ``BranchSet`` of the turn that owns it launches, runs, discards and settles it (its cost measured,
the policy told, its fork closed unless committed).

A branch starts from its ``parent``'s fork after the parent's call (a chain), else from the handle's state at
``epoch``. A kept branch moves to the next turn's ``BranchSet`` (``adopt``): it records into that turn from then
on. Cleanup is shielded, with a deadline.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup

from .._exceptions import ToolError
from .._host._pidcursor import ReadPids
from .._tools._tools import Tool
from .._workspace._accounting import workspace_memory, written_bytes
from .._workspace._facade import Workspace, abandon_calls, adopt_pids, in_place, mark_pids
from ._calls import CallKey, Launch, PredictionContext
from ._handle import CLOSE_DEADLINE, WorkspaceHandle
from ._metrics import BranchRecord, TurnLog, TurnMetrics, merge_counts
from ._planning import KeepOption, choose_kept
from ._probes import CallMeter, call_peak, fork_cost, making_bytes, memory_peak, memory_usage
from ._speculation import Speculation, policy_keeps
from ._telling import Ran, tell_run

__all__ = ["FORK_DEADLINE", "Branch", "BranchSet", "descends", "run_tool"]

FORK_DEADLINE = 60.0


class Branch:
    """A speculative call and what became of it. ``owner`` is the ``BranchSet`` of the turn that owns it now."""

    def __init__(
        self,
        launch: Launch,
        position: int,
        epoch: int,
        t: float,
        *,
        owner: BranchSet,
        ctx: PredictionContext,
        parent: Branch | None = None,
        ahead: bool = False,
    ) -> None:
        self.launch = launch
        self.ahead = ahead  # launched for the next turn's first call, before that turn started
        self.lead = 0.0  # ahead: from its launch to the start of the turn that adopted it
        self.owner = owner
        self.ctx = ctx
        self.parent = parent
        self.children: list[Branch] = []
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
        self.calling = anyio.Event()  # its call started (in its fork, for a write), or the branch ended
        self.exc: BaseException | None = None  # what ended it when it ``failed``
        self.ready_peak: int | None = None  # its fork's cgroup peak when its call started (the restore's charge)
        self.ready_usage: int | None = None  # its fork's cgroup charge then
        self.meter: CallMeter | None = None  # a fork's call: the byte-seconds it held (above what it held then)
        self.base: Workspace | None = None  # what it forked (its parent's fork, or the rollout's workspace)
        self.layer_bytes: int | None = None  # its snapshot layer: what ``base`` had written, copied for the fork
        self.lock = anyio.Lock()  # held while a chained child forks this branch's fork, and while it is committed
        self.pids: ReadPids | None = None  # run in place: the pids its processes took (put back unless used)
        self.ran = True  # taken: the plain loop would run its call there (False: a tool cache would serve it)

    def cancel(self) -> None:
        """Cancel its task. Its own fork is closed once it settles, so its cancelled call need not wait for the agent
        to reap the command (``abandon_calls``); a call in place, in a workspace that lives on, does."""
        if self.launch.needs_fork and self.ws is not None:
            abandon_calls(self.ws)
        self.scope.cancel()

    def left(self) -> None:
        """Its task ends: a read run in place that the rollout did not take never will be."""
        if self.pids is not None and not self.used:
            self.pids.drop()

    async def run_call(self, tool: Tool, args: dict[str, Any], clock: Callable[[], float], executor: object) -> None:
        """Run its call in ``ws``: ``result`` and ``error``; a fork's call metered (``CallMeter``), a read in place
        as ``read_in_place`` runs it (``executor``: the rollout's)."""
        assert self.ws is not None
        if not self.launch.needs_fork:
            self.result, self.error = await read_in_place(self, tool, args, executor)
            return
        self.meter = CallMeter(self.ws, clock) if self.forked else None
        if self.forked and isinstance(self.ws, Workspace):
            await mark_pids(self.ws)  # committed and captured, a sibling's restore continues by as many pids
        call = functools.partial(run_tool, tool, self.ws, args)
        self.result, self.error = await (self.meter.during(call) if self.meter is not None else call())

    def byte_seconds(self) -> float:
        """What a fork's call held over its run (``CallMeter``, stopped now), -1 where not measured."""
        return self.meter.stop() if self.meter is not None else -1.0


async def read_in_place(b: Branch, tool: Tool, args: dict[str, Any], executor: object) -> tuple[Any, ToolError | None]:
    """Run read branch ``b``'s call in place, in a pid-cursor scope (its pids go back unless the rollout takes it:
    ``in_place``). In the rollout's own workspace (not a chained read's, in its parent's fork: another
    state than the executor's) it goes through the executor's flight of speculative reads where it has one
    (``share``: a ``CachedSession``'s): a sibling that speculates the same read at the same state at once runs it
    for this one, which is served only if its own pids would have been the same (``adopt_pids``: its cursor
    stands where the sibling's did), and then holds the sibling's span as its own read's, so every rollout's pids
    are those of a rollout that ran the read itself."""
    ws = b.ws
    assert ws is not None
    here = isinstance(ws, Workspace)  # (an executor's workspace may be anything)
    share = getattr(executor, "share", None) if b.parent is None and here else None

    async def run() -> tuple[Any, tuple[int, int] | None]:
        async with in_place(ws) if here else contextlib.nullcontext() as b.pids:
            result, error = await run_tool(tool, ws, args)
        return (result if error is None else error), b.pids.span if b.pids is not None else None

    async def take(span: tuple[int, int] | None) -> bool:
        if span is not None:
            b.pids = await adopt_pids(ws, span)
        return b.pids is not None

    if share is None:
        outcome, _ = await run()
    else:
        outcome, _ = await share(tool.name, args, run, take)
    return (None, outcome) if isinstance(outcome, ToolError) else (outcome, None)


def descends(b: Branch, ancestor: Branch) -> bool:
    p = b.parent
    while p is not None:
        if p is ancestor:
            return True
        p = p.parent
    return False


async def run_tool(tool: Tool, ws: Workspace, args: dict[str, Any]) -> tuple[Any, ToolError | None]:
    """Run ``tool`` in ``ws``: (result, None) or (None, the ``ToolError`` it raised)."""
    if tool.handler is None:
        return None, ToolError(f"tool {tool.name!r} has no handler", tool=tool.name)
    try:
        return await tool.handler(ws, tool.normalize(args)), None
    except ToolError as exc:
        return None, exc


def fork_call_memory(b: Branch) -> tuple[int, float]:
    """What fork branch ``b``'s call raised its cgroup by (``call_peak``) and held over its run (``CallMeter``,
    stopped now), for ``observe_fork_call`` (``tell_run``)."""
    assert b.ws is not None
    return call_peak(b.ws, b.ready_peak, b.ready_usage), b.byte_seconds()


async def _fork_shielded(ws: Workspace) -> Workspace:
    """``(await ws.fork(1))[0]``, shielded from cancellation (a fork takes a few hundred ms; cancelling CRIU midway
    buys nothing), with a deadline."""
    with anyio.CancelScope(shield=True), anyio.fail_after(FORK_DEADLINE):
        copies = await ws.fork(1)
    return copies[0]


async def observe_ready(b: Branch, rollout: Workspace) -> None:
    """Fork branch ``b`` is ready, its call not yet started: what the fork holds and what its rollout holds at that
    moment, for the policy (``observe_fork``, ``observe_rollout_memory``, ``observe_copy`` where it has them). Every
    fork's, used or not: a committed one becomes the rollout and is never measured at its end. A fork holds its
    processes and the page images they map (``workspace_memory``) and the snapshot layer it mounts: a copy of what
    its base had written (its upper), made for it in the snapshot store. Measured before the call (a few /proc
    reads, milliseconds) because beside it the call's own processes (a shell, what it runs: 0.5 MiB for a
    ``sleep``) were counted as the fork's, though a hit's call would hold them on the main line alike; what a miss's
    call held is measured when it is discarded (``measure_discarded``)."""
    spec = b.owner.speculation
    observe_rollout = getattr(spec.policy, "observe_rollout_memory", None) if spec is not None else None
    if spec is None or observe_rollout is None or b.ws is None or b.base is None:
        return
    observe_copy = getattr(spec.policy, "observe_copy", None)
    fork, base = b.ws, b.base

    def measure() -> tuple[int, int]:  # a few /proc reads and fstatvfs: milliseconds, in a worker thread
        b.layer_bytes = written_bytes(base.directory)
        return workspace_memory(fork) + b.layer_bytes, workspace_memory(rollout)

    try:
        held, beside = await anyio.to_thread.run_sync(measure)
    except Exception:  # noqa: BLE001 - a reading that failed (a workspace closing meanwhile) teaches nothing
        return
    observe_transient = getattr(spec.policy, "observe_transient", None)
    making = making_bytes(b.ready_peak, b.ready_usage)
    if observe_transient is not None and making:
        observe_transient(making)
    if held and beside:
        spec.policy.observe_fork(0.0, held)
        observe_rollout(beside)
        if observe_copy is not None:
            observe_copy(held, beside, b.launch.rollout)


async def measure_discarded(b: Branch, rollout: Workspace | None) -> int:
    """Fork branch ``b`` ends unused: set its CPU seconds and memory bytes (``fork_cost`` and its layer); returns
    ``rollout``'s bytes at the same moment (0 without one). Within ``CLOSE_DEADLINE``."""
    assert b.ws is not None
    fork = b.ws

    def measure() -> tuple[tuple[float, int], int]:
        cpu, held = fork_cost(fork, b.ready_peak)
        if b.layer_bytes is None and b.base is not None:
            b.layer_bytes = written_bytes(b.base.directory)
        return (cpu, held + (b.layer_bytes or 0)), (workspace_memory(rollout) if rollout is not None else 0)

    rollout_bytes = 0
    with anyio.move_on_after(CLOSE_DEADLINE):
        (b.cpu_seconds, b.memory_bytes), rollout_bytes = await anyio.to_thread.run_sync(measure)
    return rollout_bytes


class BranchSet:
    """The branches one turn owns: ``live`` ones (running or done, not yet taken, discarded or settled) and ``all``
    it ever held. ``writing``: a main-line write of the turn runs (an in-place read must not start). ``on_ready``
    is called when a write branch finished before the model asked for it (the turn chains after it)."""

    def __init__(
        self, handle: WorkspaceHandle, tools: dict[str, Tool], speculation: Speculation | None, log: TurnLog
    ) -> None:
        self.handle, self.tools, self.speculation, self.log = handle, tools, speculation, log
        self.live: list[Branch] = []
        self.all: list[Branch] = []
        self.writing = False
        self.on_ready: Callable[[Branch], None] = lambda b: None
        self.earlier: Callable[[int, CallKey], list[anyio.Event]] = lambda p, k: []  # main-line ends before p, not k's

    def launch(self, b: Branch, tg: TaskGroup) -> None:
        """Start ``b``'s task in ``tg`` (the turn's, or the handle's when branches may outlive the turn)."""
        self.live.append(b)
        self.all.append(b)
        self.log.metrics.launched += 1
        launch = b.launch
        chained = f" after {b.parent.key.name}" if b.parent is not None else " ahead" if b.ahead else ""
        detail = f"{launch.key.name} {launch.effect.value} p={launch.probability:.2f}{chained}"
        self.log.mark("branch_launch", b.position, detail)
        tg.start_soon(self.run, b)

    def adopt(self, b: Branch) -> None:
        """Take over ``b``, kept by the previous turn (still valid: no state change since)."""
        b.owner, b.kept = self, False
        self.live.append(b)
        self.all.append(b)
        self.log.mark("branch_kept", b.position, b.key.name)
        if b.ahead and not b.lead:  # the turn it was launched for: the lead it has over a launch now
            b.lead = max(1e-9, self.log.t0 - b.launched_at)
            self.log.metrics.launched_ahead += 1
            self.log.metrics.ahead_seconds += b.lead

    def running(self) -> int:
        return sum(1 for b in self.live if not b.done.is_set())

    def forks(self) -> int:
        return sum(1 for b in self.live if b.launch.needs_fork)

    def valid(self, b: Branch) -> bool:
        """``b``'s starting state still exists: its parent's branch is alive, or no state change happened since."""
        while b.parent is not None:
            if b.parent.discarded or b.parent.failed:
                return False
            b = b.parent
        return b.epoch == self.handle.epoch and not b.discarded

    def _base(self, b: Branch) -> Workspace | None:
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

    async def run(self, b: Branch) -> None:
        """The branch's task; ``b.owner`` (not ``self``) is the set that owns it now: a kept branch moves on."""
        b.started = True
        tool = self.tools[b.key.name]
        args = b.key.arguments()
        clock = self.log.clock
        try:
            with b.scope:
                if b.launch.needs_fork:
                    t = clock()
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
                            b.base = base
                    b.forked = True
                    b.fork_seconds = clock() - t
                    # weighed before its call (whose processes a hit holds on the main line alike), and before a
                    # cancellation that came during the fork lands: a fork the ask overtook is what the policy
                    # learns a fork's bytes from when forks take longer than turns (a loaded machine)
                    with anyio.move_on_after(CLOSE_DEADLINE, shield=True):
                        b.ready_peak = memory_peak(b.ws)
                        b.ready_usage = memory_usage(b.ws)
                        await observe_ready(b, self.handle.workspace)
                    await anyio.lowlevel.checkpoint()  # a cancellation that came during the fork lands here
                    b.owner.log.mark("branch_ready", b.position, f"fork {b.fork_seconds * 1000:.0f} ms")
                else:
                    for done in self.earlier(b.position, b.key) if b.parent is None and b.owner is self else ():
                        await done.wait()  # in the rollout's workspace: after the message's calls before it
                    base = self._base(b)
                    if base is None or (b.parent is None and b.owner.writing):
                        return
                    b.ws = base
                b.run_start = clock()
                b.calling.set()
                await b.run_call(tool, args, clock, self.handle.executor)  # in place: its pids go back unless used
                b.run_end = clock()
                b.ok = True
                b.owner.log.mark("branch_done", b.position, b.key.name)
                b.done.set()
                if b.launch.needs_fork:
                    b.owner.on_ready(b)
                await b.released.wait()  # until the main line took it, or the scope is cancelled
        except Exception as exc:  # a failed branch only costs its work: the call will run normally
            b.failed, b.exc = True, exc
            b.owner.log.mark("branch_done", b.position, f"failed: {exc!r}"[:200])
        finally:
            b.done.set()
            b.calling.set()
            with anyio.CancelScope(shield=True):
                await self._settle(b)
            b.finished.set()

    async def _settle(self, b: Branch) -> None:
        """Account for a branch whose task ends, and close its fork unless it was committed."""
        owner = b.owner
        b.left()
        if b in owner.live:
            owner.live.remove(b)
        if b in self.handle.kept:
            self.handle.kept.remove(b)
        if not b.committed and b.children:  # they start from this fork: stop them before it closes
            for c in list(b.children):
                self.discard(c)
            for c in list(b.children):
                if c.started:
                    with anyio.move_on_after(FORK_DEADLINE + CLOSE_DEADLINE):
                        await c.done.wait()
        spec = owner.speculation
        if spec is not None and (b.ok or (b.forked and b.run_start and b.ws is not None)):  # hit or miss, ended or cut
            seconds = b.run_end - b.run_start if b.ok else -1.0
            tell_run(
                spec.policy, b.key, seconds, Ran.FORK if b.forked else Ran.IN_PLACE, memory=lambda: fork_call_memory(b)
            )
        observe_rollout = getattr(spec.policy, "observe_rollout_memory", None) if spec is not None else None
        rollout_bytes = 0
        if b.forked and b.ws is not None and not b.committed:
            rollout_bytes = await measure_discarded(b, self.handle.workspace if observe_rollout is not None else None)
            with anyio.move_on_after(CLOSE_DEADLINE):
                await b.ws.aclose()
        if spec is not None:
            if b.forked:  # a discarded fork's bytes: what a miss held, its call's memory included
                observe_miss = getattr(spec.policy, "observe_miss", None) if b.memory_bytes else None
                spec.policy.observe_fork(b.fork_seconds, 0 if observe_miss is not None else b.memory_bytes)
                if observe_miss is not None:
                    observe_miss(b.memory_bytes)
                if observe_rollout is not None and b.memory_bytes and rollout_bytes:
                    observe_rollout(rollout_bytes)
            release = getattr(spec.policy, "release", None)
            if release is not None:
                release(b.launch, b.used)
        self._account(b, owner)

    def _account(self, b: Branch, owner: BranchSet) -> None:
        """Count ``b``'s outcome in its owner's turn (and, if that turn has ended, in its rollout's sums)."""
        m = TurnMetrics(turn=owner.log.metrics.turn)
        if b.used:
            outcome: Literal["committed", "wasted", "failed"] = "committed"
            m.committed += 1
            m.saved_seconds += b.saved
        else:
            outcome = "failed" if b.failed else "wasted"
            end = b.run_end if b.run_end else self.log.clock()
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
            owner.log.mark("branch_discard", b.position, b.key.name)
        m.fork_seconds += b.fork_seconds
        merge_counts(owner.log.metrics, m)
        if owner.log.finalized:  # a kept branch ended after its last turn (the rollout ended): count it still
            merge_counts(self.handle.metrics, m)
            if owner.speculation is not None:
                merge_counts(owner.speculation.metrics, m)
        owner.log.metrics.branches.append(
            BranchRecord(
                position=b.position,
                tool=b.key.name,
                effect=b.launch.effect.value,
                source=b.launch.candidate.source,
                probability=b.launch.probability,
                outcome=outcome,
                launched_at=b.launched_at - owner.log.t0,
                fork_seconds=b.fork_seconds,
                run_seconds=(b.run_end - b.run_start) if b.run_end else 0.0,
                cpu_seconds=b.cpu_seconds,
                memory_bytes=b.memory_bytes,
                saved_seconds=b.saved,
                depth=b.depth,
                ahead=b.ahead,
            )
        )

    def cancel(self, which: Callable[[Branch], bool]) -> None:
        """Discard the live branches ``which`` selects (not one the main line claimed)."""
        for b in list(self.live):
            if not b.claimed and not b.discarded and which(b):
                self.discard(b)

    def discard(self, b: Branch) -> None:
        """Cancel ``b`` and every branch chained after it (they start from its state)."""
        stack = [b]
        while stack:
            c = stack.pop()
            if c.claimed or c.discarded:
                continue
            c.discarded = True
            if c in c.owner.live:
                c.owner.live.remove(c)
            if c in self.handle.kept:
                self.handle.kept.remove(c)
            c.cancel()
            stack.extend(c.children)

    async def quiesce(self) -> None:
        """Wait until every branch that runs in the current workspace has stopped (they were cancelled): a read's
        task ends once its processes are gone (a cancelled call waits for the agent to reap them, ``_client``), so
        the main line's next call or state read never sees one still exiting."""
        for b in list(self.all):
            if not b.launch.needs_fork and b.parent is None and not b.done.is_set():
                await b.done.wait()

    async def wait_finished(
        self, keep: list[Branch], *, started_only: bool = False, in_place_only: bool = False
    ) -> None:
        """Wait until each branch this set owns (not in ``keep``) has settled; ``started_only``: with a deadline,
        only those whose task began (a cancelled turn's: one that never started holds nothing); ``in_place_only``:
        only those that run in the rollout's workspace (the others run in the handle's task group and close their
        own forks as they settle: the next model request need not wait for that)."""
        for b in self.all:
            if b.owner is not self or b in keep:
                continue
            if in_place_only and (b.launch.needs_fork or b.parent is not None):
                continue
            if not started_only:
                await b.finished.wait()
            elif b.started:
                with anyio.move_on_after(FORK_DEADLINE + CLOSE_DEADLINE):
                    await b.finished.wait()

    async def hand_over(self, limit: int, ahead: Collection[Branch] = (), *, background: bool = False) -> list[Branch]:
        """End this set's branches but at most ``limit`` unused ones whose state is still valid and which the policy
        would keep (``policy_keeps``), with the chains they follow (finished ones first, then the likeliest:
        ``choose_kept``), and the ``ahead`` ones (launched for the next turn's first call: the policy chose them for
        that turn), which are returned, marked kept, for the next turn to ``adopt``. ``background``: the branches
        run in the handle's task group; those in forks settle there, unawaited."""
        by_id: dict[int, Branch] = {}
        options: list[KeepOption] = []
        unpaid: list[Branch] = []
        for b in self.live if limit > 0 else ():
            if b in ahead or b.claimed or b.discarded or b.failed or not self.valid(b):
                continue
            if not policy_keeps(self.speculation, b.launch):  # another turn's hold would not pay: let it go
                unpaid.append(b)
                continue
            chain = [b]
            while (parent := chain[-1].parent) is not None:
                chain.append(parent)
            by_id.update((id(c), c) for c in chain)
            options.append(KeepOption(b.done.is_set(), b.launch.probability, tuple(id(c) for c in chain)))
        keep = [by_id[i] for i in choose_kept(options, limit)]
        self.log.metrics.released += sum(b not in keep for b in unpaid)  # (one a kept chain starts from stays)
        keep += [b for b in ahead if b in self.live]  # (one that failed already settled)
        self.cancel(lambda b: b not in keep)
        await self.wait_finished(keep, in_place_only=background)
        for b in keep:
            b.kept = True
            if b in self.live:
                self.live.remove(b)
        return keep

    async def close_leftovers(self, *, settling_too: bool = True) -> None:
        """Close the forks of branches this set still owns that were neither kept nor committed; ``settling_too``
        (else a branch whose task still settles is left to close its own fork)."""
        for b in self.all:
            if b.owner is not self or b.kept or (not settling_too and b.started and not b.finished.is_set()):
                continue
            if b.ws is not None and b.forked and not b.committed and not b.ws.closed:
                with anyio.move_on_after(CLOSE_DEADLINE):
                    await b.ws.aclose()
