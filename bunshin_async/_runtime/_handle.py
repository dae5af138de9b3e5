"""``WorkspaceHandle``: the agent loop's reference to "its" workspace, which speculation may replace.

A committed speculative write means the rollout now lives in the branch's fork. The handle is the one place the
agent loop reads the workspace from, so the swap is a single assignment made under the handle's lock: whoever
holds the handle sees either the old workspace (before the call) or the new one (after it), never a mix. Code that
needs a stable workspace across several awaits takes ``async with handle.pinned() as ws``.

A handle made ``over`` an ``Executor`` (a ``CachedSession``, the agent's ``WorkspaceExecutor``) owns nothing: the
main line's calls run through the executor, a committed branch is handed to ``executor.adopt``, and the handle's
workspace is whatever the executor's is now (a cache write hit may have replaced it).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import anyio
from anyio.abc import TaskGroup

from .._compat import BaseExceptionGroup
from .._exceptions import InvalidValue, UsageError
from .._workspace._facade import Workspace
from ._calls import CallKey, chain_root, extend_chain
from ._metrics import RolloutMetrics

__all__ = ["Executor", "Runner", "WorkspaceHandle", "WorkspaceSlot"]

CLOSE_DEADLINE = 10.0
_ids = itertools.count()


class WorkspaceSlot:
    """The one place a rollout's current workspace is replaced: holds it with whether the holder closes it
    (``owned``). Shared by ``WorkspaceHandle``, ``CachedSession`` and the agent's ``WorkspaceExecutor``."""

    __slots__ = ("owned", "workspace")

    def __init__(self, workspace: Workspace, *, own: bool) -> None:
        self.workspace, self.owned = workspace, own

    async def swap(self, new: Workspace) -> bool:
        """Point at ``new`` (owned from now on) and close the previous workspace if it was owned; False (and nothing
        changes) when ``new`` is the current one. Closing is shielded, with a deadline."""
        if new is self.workspace:
            return False
        old, owned = self.workspace, self.owned
        self.workspace, self.owned = new, True
        if owned:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_DEADLINE):
                await old.aclose()
        return True

    def detach(self) -> Workspace:
        """The current workspace, from now on the caller's to close."""
        self.owned = False
        return self.workspace

    async def aclose(self) -> None:
        """Close the current workspace if owned (shielded, with a deadline). Idempotent."""
        if self.owned:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_DEADLINE):
                await self.workspace.aclose()


@runtime_checkable
class Runner(Protocol):
    """What runs a rollout's main-line calls (the plain loop needs no more): ``call`` returns the tool's result or
    raises its ``ToolError``, and may replace ``workspace``."""

    @property
    def workspace(self) -> Workspace: ...

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Any: ...


@runtime_checkable
class Executor(Runner, Protocol):
    """What runs a rollout's calls for the speculative turn runtime (``CachedSession``, ``agent.WorkspaceExecutor``).

    ``call`` runs a main-line call (the tool's result, or its ``ToolError`` raised) and may replace ``workspace``.
    ``adopt`` accounts a call a speculative branch ran as if ``call`` had run it: ``workspace`` is where it ran (a
    committed fork for a write, which the executor owns from then on; the current workspace for a read), ``result``
    the tool's result or its ``ToolError``, ``duration`` its run time in seconds.
    An executor may also have ``move(workspace)``: continue in a write branch's fork while its call still runs
    (owned from then on, the previous workspace closed), ``adopt`` of the same workspace following once the call
    ended; the rollout then holds one workspace, not two, for the rest of that call. Without it the runtime waits
    for the call to end before it commits. And ``share(tool, args, run, take)``: a speculative read run in place
    goes through it (a ``CachedSession``'s flight of speculative reads: a sibling's identical read serves it, if
    ``take`` accepts what it left, instead of ``run``), which returns the outcome (the result or the ``ToolError``)
    and whether ``run`` ran.
    """

    async def adopt(
        self, workspace: Workspace, tool: str, args: Mapping[str, Any], result: Any, duration: float
    ) -> object: ...


class WorkspaceHandle:
    """Points at the rollout's current workspace and tracks its call history.

    ``own=True`` (the default) makes the handle responsible for closing the workspace it points at when it is
    replaced or when the handle is closed; with ``own=False`` the first workspace stays the caller's, while forks
    committed later are always owned. ``epoch`` counts the committed state changes (it names the workspace state
    for matching branches); ``chain`` is the prefix hash of every call made so far (reads too), the key sibling
    rollouts share. ``salt`` separates tasks (use the task id: rollouts of one group must use the same salt).
    ``metrics`` sums the speculation metrics of its turns.

    Inside ``async with handle.background():`` (``run_agent`` opens it) speculative branches run in the handle's
    task group instead of their turn's, so a branch the turn did not use may stay alive into the next turns
    (``kept``, the turn runtime's) while the state it started from is unchanged; leaving the block cancels them
    and closes their forks. Nothing may change the workspace between the turns of such a block but the turns.
    """

    def __init__(self, workspace: Workspace, *, own: bool = True, salt: str = "") -> None:
        self._slot = WorkspaceSlot(workspace, own=own)
        self.executor: Runner | None = None
        self._lock = anyio.Lock()
        self.epoch = 0
        self.chain = chain_root(salt)
        self.history: list[CallKey] = []
        self.last_output = ""  # what the latest finished call printed (PredictionContext.last_output)
        self.salt = salt
        self.swaps = 0
        self.turns = 0
        self.metrics = RolloutMetrics()
        self.name = f"rollout-{next(_ids)}"  # stable over the handle's life: what a shared policy keys on
        self.kept: list[Any] = []  # branches handed from one turn to the next (the turn runtime's _Branch)
        self.tasks: TaskGroup | None = None

    @classmethod
    def over(cls, executor: Runner, *, salt: str = "") -> WorkspaceHandle:
        """A handle that follows ``executor``'s workspace and owns none: calls run and branches commit through it
        (a branch only with an ``Executor``: a ``Runner`` serves the plain path)."""
        handle = cls(executor.workspace, own=False, salt=salt)
        handle.executor = executor
        return handle

    @property
    def workspace(self) -> Workspace:
        """The current workspace. Between turns it is stable; during a turn use ``pinned()`` for several awaits."""
        return self.executor.workspace if self.executor is not None else self._slot.workspace

    @asynccontextmanager
    async def pinned(self) -> AsyncIterator[Workspace]:
        """Hold the current workspace: no swap happens inside the block."""
        async with self._lock:
            yield self.workspace

    @property
    def lock(self) -> anyio.Lock:
        """Held while the state changes (a write runs, a fork is taken, a branch is committed)."""
        return self._lock

    def record(self, call: CallKey) -> None:
        """Append ``call`` (as the model made it) to the history."""
        self.history.append(call)
        self.chain = extend_chain(self.chain, call)

    def advance(self) -> None:
        """The workspace state changed (a write ran or a branch was committed). Caller holds ``lock``."""
        self.epoch += 1

    async def commit(self, workspace: Workspace, call: CallKey, result: Any, duration: float) -> None:
        """A branch's call is the rollout's: for a write ``workspace`` is its fork, from now on the handle's (or the
        executor's); for a read it is the current workspace. ``result`` is the result or the ``ToolError``. Caller
        holds ``lock`` for a write. Whatever happens, a fork passed here is owned by someone afterwards."""
        if self.executor is not None:
            if not isinstance(self.executor, Executor):
                raise InvalidValue(
                    f"speculation needs an executor with adopt(), not {self.executor!r}", argument="executor"
                )
            before = self.executor.workspace
            await self.executor.adopt(workspace, call.name, call.arguments(), result, duration)
            self.swaps += self.executor.workspace is not before
        elif await self._slot.swap(workspace):
            self.swaps += 1

    @property
    def can_move(self) -> bool:
        """Whether ``move`` can take a fork whose call still runs (an executor needs a ``move`` method)."""
        return self.executor is None or callable(getattr(self.executor, "move", None))

    async def move(self, workspace: Workspace) -> None:
        """The rollout continues in ``workspace``, a write branch's fork whose call still runs: from now on it is the
        handle's (or the executor's, through its ``move``) and the previous workspace is closed (if owned); the
        call is recorded by ``commit`` once it ended. Caller holds ``lock`` until then (``can_move`` first)."""
        if self.executor is not None:
            before = self.executor.workspace
            await getattr(self.executor, "move")(workspace)  # noqa: B009 (optional: can_move checked it)
            self.swaps += self.executor.workspace is not before
        elif await self._slot.swap(workspace):
            self.swaps += 1

    @asynccontextmanager
    async def background(self) -> AsyncIterator[WorkspaceHandle]:
        """Let speculative branches outlive their turn (see the class docstring). Leaving the block cancels what
        is still alive and waits for it to close its forks."""
        if self.tasks is not None:
            raise UsageError("handle.background() is already active", what="WorkspaceHandle.background")
        try:
            async with anyio.create_task_group() as tg:
                self.tasks = tg
                try:
                    yield self
                finally:
                    self.tasks = None
                    for b in self.kept:  # no turn takes them now: a fork's is closed as it settles (``Branch.cancel``)
                        b.cancel()
                    self.kept = []
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the block's own error (branch tasks catch theirs), as it was raised
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    async def aclose(self) -> None:
        """Close the current workspace if the handle owns it (never with an executor). Idempotent."""
        if self.executor is None:
            await self._slot.aclose()

    async def __aenter__(self) -> WorkspaceHandle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<WorkspaceHandle {self.workspace.id} epoch={self.epoch} calls={len(self.history)}>"
