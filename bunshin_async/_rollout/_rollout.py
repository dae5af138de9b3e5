"""The rollout API for RL trainers: GRPO groups forked from one warm workspace.

``GroupRollout`` sets a task's workspace up once (the expensive part: installs, builds, warm interpreters), forks it
``n`` ways when that pays (``ForkRule``), runs the ``n`` agent loops concurrently and yields each rollout as it
finishes, so a trainer can consume results without waiting for stragglers. A rollout that hits a budget is stopped,
marked truncated with the reason and masked out (``loss_mask == 0``): a trainer must not learn from a cut-off attempt
as if it had finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal, Protocol

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._exceptions import BunshinError, InvalidValue, describe
from .._host._kernel import Limits
from .._host._security import Security
from .._images._image import Image
from .._workspace._accounting import ResourceMonitor, workspace_memory
from .._workspace._facade import Workspace
from ._trajectory import Trajectory

log = logging.getLogger("bunshin_async.rollout")

__all__ = [
    "Budget",
    "ForkRule",
    "GroupRollout",
    "RolloutAgent",
    "RolloutContext",
    "RolloutResult",
    "Task",
    "WorkspaceLimiter",
    "command_reward",
]

TRUNCATING_STOPS = {"max_turns", "max_context_tokens", "max_tokens", "wall_clock"}


class Budget(msgspec.Struct, frozen=True):
    """Per-rollout limits; None disables one. ``wall_seconds`` counts from the rollout's start (after the fork)."""

    max_turns: int | None = 50
    max_context_tokens: int | None = None
    wall_seconds: float | None = 600.0


class Task(msgspec.Struct, frozen=True):
    """A task: files to put in the workspace directory, set-up commands run once per group (or once per rollout
    without fork), and a reward command run in each rollout's workspace at the end (exit 0 earns 1.0)."""

    task_id: str
    prompt: str
    files: dict[str, bytes] = msgspec.field(default_factory=dict)
    setup: list[str] = msgspec.field(default_factory=list)
    background: list[str] = msgspec.field(default_factory=list)  # long-running set-up processes (kernels, servers)
    ready: list[str] = msgspec.field(default_factory=list)  # polled until each exits 0: the set-up is warm
    reward_command: str | None = None
    setup_timeout: float = 600.0
    image: Image | str | None = None  # the image its workspaces run (a reference is looked up in the layer store)


class ForkRule(msgspec.Struct, frozen=True):
    """When forking a group's set-up pays (``GroupRollout(fork=True)``), by the work of the whole group: the CPU
    seconds and the memory a run on a shared machine runs out of.

    Not forked, a group of ``n`` sets up ``n`` times (the base for rollout 0, then each other rollout its own) and
    holds what a set-up leaves ``n`` times. Forked, it sets up once, dumps once and restores ``n`` copies, which
    share the base's pages. So a fork spares ``n - 1`` set-ups and ``n - 1`` times the set-up's memory, and costs
    one dump plus ``n`` restores (about 0.3 s and 0.1 s each for a small workspace): it pays when
    ``(n - 1) x setup_seconds >= min_setup_seconds + (n - 2) x restore_seconds`` (the set-ups spared beat the dump
    and the restores) or when ``(n - 1) x extra_bytes >= min_extra_bytes`` (the set-up left enough beyond a fresh
    workspace for sharing it to matter). The thresholds are a pair's (``n = 2``: a set-up of 0.5 s or 16 MiB); a
    larger group forks a cheaper set-up (``n = 16``: 0.13 s or 1.1 MiB), never one shorter than a restore.
    Latency does not grow with ``n`` either way: the copies start after the dump and their restores, the fresh
    rollouts after a set-up of their own, in parallel. Otherwise every rollout but the base's starts fresh and
    repeats the cheap set-up."""

    min_setup_seconds: float = 0.5
    min_extra_bytes: int = 16 << 20
    restore_seconds: float = 0.1

    def pays(self, setup_seconds: float, extra_bytes: int, n: int = 2) -> bool:
        """Pure: ``setup_seconds`` the base's set-up took, ``extra_bytes`` it holds beyond a fresh workspace, for a
        group of ``n`` rollouts (a group of one never pays: nothing is spared)."""
        spared = n - 1
        cost = self.min_setup_seconds + (n - 2) * self.restore_seconds
        return spared > 0 and (spared * setup_seconds >= cost or spared * extra_bytes >= self.min_extra_bytes)


class RolloutResult(msgspec.Struct):
    """One rollout's outcome: its trajectory, reward and timings, and whether a trainer may learn from it."""

    task_id: str
    rollout: int
    status: Literal["finished", "truncated", "failed"]
    loss_mask: float  # 1.0: learn from it; 0.0: truncated or failed, exclude it
    trajectory: Trajectory | None = None
    reason: str | None = None  # why it was truncated or failed
    reward: float | None = None
    reward_output: str | None = None
    wall_seconds: float = 0.0
    llm_seconds: float = 0.0
    tool_seconds: float = 0.0
    fork_mode: str = "fresh"


class RolloutContext:
    """What an agent gets: the rollout's workspace (an agent that swaps it, e.g. after committing a speculative
    fork, assigns ``ctx.ws``; the group closes whichever workspace is current at the end) and its budget."""

    def __init__(self, task: Task, rollout: int, ws: Workspace, budget: Budget) -> None:
        self.task = task
        self.rollout = rollout
        self.ws = ws
        self.budget = budget
        self.started = time.monotonic()


class RolloutAgent(Protocol):
    """What ``GroupRollout`` runs in each copy: the agent loop of one rollout, returning its trajectory."""

    async def run(self, ctx: RolloutContext) -> Trajectory: ...


class WorkspaceLimiter:
    """A global limit on live workspaces shared by many groups. ``reserve(k)`` waits until ``k`` more fit, all at
    once (a group reserves its ``n`` copies together, so groups cannot deadlock on partial reservations). Memory
    follows: each workspace is capped by its ``Limits.memory``, so ``max_workspaces * memory`` bounds the run
    (plus one base workspace per group while it forks)."""

    def __init__(self, max_workspaces: int) -> None:
        if max_workspaces < 1:
            raise InvalidValue("max_workspaces must be at least 1", argument="max_workspaces")
        self.max_workspaces = max_workspaces
        self.in_use = 0
        self.peak = 0
        self._changed = anyio.Condition()

    async def acquire(self, k: int = 1) -> None:
        if k > self.max_workspaces:
            raise InvalidValue(f"cannot reserve {k} workspaces under a limit of {self.max_workspaces}", argument="k")
        async with self._changed:
            while self.in_use + k > self.max_workspaces:
                await self._changed.wait()
            self.in_use += k
            self.peak = max(self.peak, self.in_use)

    async def release(self, k: int = 1) -> None:
        with anyio.CancelScope(shield=True):
            async with self._changed:
                self.in_use -= k
                self._changed.notify_all()


def _prepares_something(task: Task) -> bool:
    return bool(task.files or task.setup or task.background or task.ready)


async def prepare(ws: Workspace, task: Task) -> None:
    """Put the task's files in place, run its set-up, start its background processes and wait until its ``ready``
    checks pass (a fork taken before a warm interpreter has built its state would copy a half-built one)."""
    for path, data in task.files.items():
        await ws.write_file(path, data)
    for cmd in task.setup:
        r = await ws.exec(cmd, timeout=task.setup_timeout)
        if r.exit_code != 0:
            raise BunshinError(f"task {task.task_id}: set-up `{cmd}` exited {r.exit_code}: {r.stderr[-500:]}")
    for i, cmd in enumerate(task.background):
        await ws.spawn(cmd, log_path=f".bunshin-bg-{i}.log")
    with anyio.fail_after(task.setup_timeout):
        for cmd in task.ready:
            delay = 0.01
            while (await ws.exec(cmd, timeout=task.setup_timeout)).exit_code != 0:
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.25)


class GroupRollout:
    """``async with GroupRollout(task, n, agent) as group: async for result in group: ...``

    With ``fork=True`` the task is set up once in a base workspace that is then forked ``n`` ways (BunshinFork) if
    ``fork_rule`` says the fork pays (a slow set-up, or one that holds memory); if not, the base runs rollout 0 as it
    is and the other rollouts start fresh. A group of one, or a task with nothing to prepare (no files, set-up,
    background or ready checks), is not forked: its rollouts all start fresh at once, as in the baseline.
    ``fork="always"`` forks regardless; with ``fork=False`` each rollout creates its own workspace and repeats the
    set-up (the baseline). ``forked`` says what the group did (None until it has decided). Leaving the
    ``async with`` early (or cancelling it) stops every rollout and frees every workspace. ``image`` (an ``Image``
    or a reference in the layer store, as ``bunshin image import`` left it) overrides the task's ``image``; with
    neither, the base image.
    """

    def __init__(
        self,
        task: Task,
        n: int,
        agent: RolloutAgent,
        *,
        budget: Budget | None = None,
        fork: bool | Literal["always"] = True,
        fork_rule: ForkRule | None = None,
        image: Image | str | None = None,
        limits: Limits | None = None,
        security: Security | None = None,
        limiter: WorkspaceLimiter | None = None,
        monitor: ResourceMonitor | None = None,
        reward: Callable[[Workspace, Task], Awaitable[tuple[float, str]]] | None = None,
    ) -> None:
        if n < 1:
            raise InvalidValue("n must be at least 1", argument="n")
        if fork not in (True, False, "always"):
            raise InvalidValue(f"fork must be True, False or 'always', not {fork!r}", argument="fork")
        self.task = task
        self.n = n
        self.agent = agent
        self.budget = budget or Budget()
        self.fork = fork
        self.fork_rule = fork_rule or ForkRule()
        image = image if image is not None else task.image
        self.image = Image.load(image) if isinstance(image, str) else image
        self.limits = limits
        self.security = security
        self.limiter = limiter or WorkspaceLimiter(1 << 30)  # no limit
        self.monitor = monitor
        self.reward = reward or command_reward
        self._send: MemoryObjectSendStream[RolloutResult] | None = None
        self._receive: MemoryObjectReceiveStream[RolloutResult] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.setup_seconds: float | None = None
        # Decided now when nothing can be shared: a group of one, or a task that prepares nothing (a fork would only
        # add its dump, restores and page image, and the base's set-up would delay the other rollouts' start).
        shares = fork == "always" or (fork is True and n > 1 and _prepares_something(task))
        self.forked: bool | None = None if shares else False

    async def __aenter__(self) -> GroupRollout:
        self._send, self._receive = anyio.create_memory_object_stream[RolloutResult](self.n)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run_group)
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool | None:
        assert self._tg is not None and self._receive is not None
        self._tg.cancel_scope.cancel()  # rollouts not consumed by now are abandoned; their workspaces are freed
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)  # type: ignore[arg-type]
        finally:
            self._receive.close()

    def __aiter__(self) -> AsyncIterator[RolloutResult]:
        assert self._receive is not None, "use `async with GroupRollout(...)` first"
        return self._receive.__aiter__()

    async def collect(self) -> list[RolloutResult]:
        """All results, in completion order."""
        return [r async for r in self]

    # ------------------------------------------------------------------------------------------------ internals

    def _new_workspace(self) -> Workspace:
        return Workspace(self.image, limits=self.limits, security=self.security)

    async def _run_group(self) -> None:
        assert self._send is not None
        async with self._send:
            if self.forked is False:  # decided up front: each rollout in a workspace of its own, as without fork
                async with anyio.create_task_group() as tg:
                    for i in range(self.n):
                        tg.start_soon(self._rollout_fresh, i)
                return
            await self.limiter.acquire(self.n)  # the copies; the base rides on one of them until it is closed
            try:
                first = await self._setup_and_fork()
            except BaseException as exc:
                await self.limiter.release(self.n)
                if not isinstance(exc, Exception):
                    raise
                for i in range(self.n):
                    await self._send.send(self._failed(i, f"group set-up failed: {exc}"))
                return
            async with anyio.create_task_group() as tg:
                for i, ws in enumerate(first):
                    tg.start_soon(self._rollout_in, i, ws)
                for i in range(len(first), self.n):  # not forked: fresh, each on a token reserved above
                    tg.start_soon(self._rollout_fresh, i, True)

    async def _setup_and_fork(self) -> list[Workspace]:
        """The group's set-up workspaces, each holding one of the group's limiter tokens: ``n`` copies of the base
        if the group forks, else the base itself (rollout 0). Sets ``forked`` and ``setup_seconds``."""
        t0 = time.monotonic()
        base: Workspace | None = self._new_workspace()
        assert base is not None
        try:
            await base.start()
            if self.monitor:
                self.monitor.track(base)
            weigh = self.fork is True
            fresh_bytes = await anyio.to_thread.run_sync(workspace_memory, base) if weigh else 0
            t1 = time.monotonic()
            await prepare(base, self.task)
            t2 = time.monotonic()
            self.setup_seconds = t2 - t0
            if weigh:
                extra_bytes = await anyio.to_thread.run_sync(workspace_memory, base) - fresh_bytes
                self.forked = self.fork_rule.pays(t2 - t1, extra_bytes, self.n)
            else:  # "always", unless a group of one: a snapshot would only cost its dump and its memory
                self.forked = self.n > 1
            if not self.forked:
                keep, base = base, None
                return [keep]
            copies = await base.fork(self.n)
            if self.monitor:
                for c in copies:
                    self.monitor.track(c)
            return copies
        finally:
            if base is not None:
                if self.monitor:
                    self.monitor.untrack(base)
                await base.aclose()

    async def _rollout_fresh(self, i: int, reserved: bool = False) -> None:
        """Runs rollout ``i`` in a workspace of its own, set up by itself; ``reserved``: the caller holds its token."""
        ws = self._new_workspace()
        if not reserved:
            await self.limiter.acquire()
        try:
            try:
                await ws.start()
                if self.monitor:  # the set-up is part of what a rollout costs without fork
                    self.monitor.track(ws)
                t0 = time.monotonic()
                await prepare(ws, self.task)
                self.setup_seconds = time.monotonic() - t0
            except BaseException:
                if self.monitor:
                    self.monitor.untrack(ws)
                await ws.aclose()
                await self.limiter.release()
                raise
        except Exception as exc:
            assert self._send is not None
            await self._send.send(self._failed(i, f"set-up failed: {exc}"))
            return
        await self._rollout_in(i, ws)

    async def _rollout_in(self, i: int, ws: Workspace) -> None:
        """Runs one rollout in ``ws``, whose limiter token the caller already holds; frees both at the end."""
        assert self._send is not None
        ctx = RolloutContext(self.task, i, ws, self.budget)
        if self.monitor:
            self.monitor.track(ws)
        try:
            result = await self._drive(ctx)
        finally:
            if self.monitor:
                self.monitor.untrack(ctx.ws)
                self.monitor.untrack(ws)
            await ctx.ws.aclose()
            await ws.aclose()
            await self.limiter.release()
        await self._send.send(result)

    async def _drive(self, ctx: RolloutContext) -> RolloutResult:
        task, i = self.task, ctx.rollout
        trajectory: Trajectory | None = None
        status: Literal["finished", "truncated", "failed"] = "finished"
        reason: str | None = None
        with anyio.move_on_after(self.budget.wall_seconds) as scope:
            try:
                trajectory = await self.agent.run(ctx)
            except Exception as exc:  # the group goes on without it
                status, reason = "failed", describe(exc)
                log.warning("rollout %s#%d failed", task.task_id, i, exc_info=exc)
        if scope.cancelled_caught:
            status, reason = "truncated", "wall_clock"
        elif trajectory is not None and trajectory.stop_reason in TRUNCATING_STOPS:
            status, reason = "truncated", trajectory.stop_reason
        result = RolloutResult(
            task_id=task.task_id,
            rollout=i,
            status=status,
            loss_mask=1.0 if status == "finished" else 0.0,
            trajectory=trajectory,
            reason=reason,
            wall_seconds=time.monotonic() - ctx.started,
            fork_mode=ctx.ws.fork_mode,
        )
        if trajectory is not None:
            result.llm_seconds = sum(s.llm_seconds or 0.0 for s in trajectory.steps)
            result.tool_seconds = sum(s.tool_seconds or 0.0 for s in trajectory.steps)
        if status == "finished" and not ctx.ws.closed:
            try:
                result.reward, result.reward_output = await self.reward(ctx.ws, task)
            except BunshinError as exc:
                result.reward, result.reward_output = 0.0, f"reward hook failed: {exc}"
        return result

    def _failed(self, i: int, reason: str) -> RolloutResult:
        return RolloutResult(task_id=self.task.task_id, rollout=i, status="failed", loss_mask=0.0, reason=reason)


async def command_reward(ws: Workspace, task: Task) -> tuple[float, str]:
    """The default reward: 1.0 if the task's ``reward_command`` exits 0 in the rollout's workspace."""
    if task.reward_command is None:
        return 0.0, "no reward command"
    r = await ws.exec(task.reward_command, timeout=300)
    return (1.0 if r.exit_code == 0 else 0.0), (r.stdout + r.stderr)[-2000:]
