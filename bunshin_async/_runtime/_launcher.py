"""Where a turn's branches come from, and when they start: the next undecided call at each decision point while
the message streams (``replan``), the call after a write branch that finished before the model asked for it
(``chain``) and, once every call of the message has its result, the next turn's first call (``ahead``): at that
moment its starting state and the observation the model will reason about are known, and this turn's cleanup, the
agent loop's bookkeeping and the next model request still lie between it and the next turn's start.

The policy chooses within its budgets (``Policy.select``) over what the ``Planner`` offers; branches run in the
turn's task group, or in the handle's when they may outlive the turn (``keeping``: ``Speculation.keep`` inside
``handle.background()``), which ``ahead`` needs: its branches belong to the next turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from anyio.abc import TaskGroup

from ._branches import Branch, BranchSet
from ._calls import CallKey, Launch, PredictionContext
from ._handle import WorkspaceHandle
from ._mainline import MainLine
from ._metrics import TurnLog
from ._nearmiss import outcome_text
from ._planning import Planner, context_after
from ._speculation import Speculation, policy_active, policy_keeps

__all__ = ["Launcher"]


class Launcher:
    """A turn's launch decisions. ``tg`` is the turn's task group (None outside ``async with``), ``calls`` the
    number of calls of the message once it finished (None while it streams), ``closing``: the turn is ending, no
    new branch starts (a chain launched now would never be waited for)."""

    def __init__(
        self,
        handle: WorkspaceHandle,
        speculation: Speculation | None,
        planner: Planner,
        branches: BranchSet,
        log: TurnLog,
    ) -> None:
        self.handle, self.speculation, self.planner, self.branches, self.log = (
            handle, speculation, planner, branches, log,
        )  # fmt: skip
        self.main: MainLine | None = None  # set by the turn once its main line exists (it calls ``replan``)
        self.tg: TaskGroup | None = None
        self.calls: int | None = None
        self.closing = False

    @property
    def keeping(self) -> bool:
        """Branches may outlive this turn (``Speculation.keep`` inside ``handle.background()``)."""
        return self.speculation is not None and self.speculation.keep > 0 and self.handle.tasks is not None

    def context(self, position: int) -> PredictionContext:
        """The context of call ``position`` of the message (the calls decided before it known)."""
        assert self.main is not None
        decided = [d.key for d in self.main.decided[:position] if d.key is not None]
        return self.planner.context(position, decided)

    def replan(self, exclude: tuple[CallKey, bytes] | None = None) -> None:
        """Ask the predictors about the next undecided call and launch what the policy picks. Only while the
        next call's starting state exists: the message is still streaming and no decided write is pending.
        ``exclude``: a call and the state it was decided in, not launched from that state."""
        spec, main = self.speculation, self.main
        if spec is None or main is None or self.calls is not None or self.tg is None or self.closing:
            return
        if self.branches.writing or main.write_pending:
            return
        if not policy_active(spec):
            self.log.metrics.paused += 1
            return
        position = len(main.decided)
        ctx = self.context(position)
        epoch = self.handle.epoch
        running = {b.key for b in self.branches.live if b.parent is None and b.epoch == epoch}
        running |= {d.key for d in main.decided if d.key is not None and not d.done.is_set()}  # runs anyway
        if exclude is not None and exclude[1] == ctx.chain:
            running.add(exclude[0])
        self._start(self.planner.options(ctx, exclude=running), ctx, position)

    def sibling(self, call: CallKey, state: bytes) -> None:
        """A sibling of the group decided ``call`` in ``state`` (``Speculation.signal``): plan again with what the
        predictors learned from it, but not that call from that same state: the prefix cache serves it (a write
        in flight is its single flight; a read once it ended), and reads launched in place for it ran beside the
        cache's (offline, the 26 terminal-bench tasks: 177 launches more for 0.05% of group latency)."""
        self.replan((call, state))

    def ahead(self) -> list[Branch]:
        """Every call of the finished message has its result: launch what the policy picks of the calls predicted
        to open the next turn (its position 0, from the current state and the last observation), for the next
        turn to adopt (those the policy would keep for it). Nothing without ``Speculation.on_observation``, kept
        branches or a call in this message."""
        spec, main = self.speculation, self.main
        if spec is None or not spec.on_observation or not self.keeping or self.closing or self.tg is None:
            return []
        if main is None or not main.decided or main.write_pending or not policy_active(spec):
            return []
        ctx = self.planner.context(0, (), ahead=True)
        running = {b.key for b in self.branches.live if b.parent is None and b.epoch == self.handle.epoch}
        options = self.planner.options(ctx, exclude=running, ahead=True)
        # handed to the next turn: only what the policy would keep for it (``Policy.keeps``)
        return self._start([o for o in options if policy_keeps(spec, o)], ctx, 0, ahead=True)

    def chain(self, b: Branch) -> None:
        """``b`` (a write) finished before the model asked for it: launch what the policy picks of the calls
        predicted to follow it, in forks of ``b``'s fork (reads in ``b``'s fork itself)."""
        spec = self.speculation
        if spec is None or self.closing or self.tg is None or b.discarded or b.claimed:
            return
        ctx = b.ctx
        if not self.keeping and self.calls is not None and ctx.position + 1 >= self.calls:
            return  # the message has no call after b's: without kept branches the child would be discarded
        if not policy_active(spec):
            return
        after = context_after(ctx, b.key, outcome_text(b.result, b.error))
        exclude = {c.key for c in b.children}
        options = self.planner.options(after, exclude=exclude, parent=b.launch)
        self._start(options, after, after.position, parent=b)

    def _start(
        self,
        options: Sequence[Launch],
        ctx: PredictionContext,
        position: int,
        *,
        parent: Branch | None = None,
        ahead: bool = False,
    ) -> list[Branch]:
        """Launch what the policy selects of ``options`` (for call ``position``, predicted in ``ctx``)."""
        spec = self.speculation
        if not options or spec is None:
            return []
        epoch = parent.epoch if parent is not None else self.handle.epoch
        started = []
        for launch in spec.policy.select(options, running=self.branches.running(), forks=self.branches.forks()):
            b = Branch(launch, position, epoch, self.log.clock(), owner=self.branches, ctx=ctx, parent=parent,
                       ahead=ahead)  # fmt: skip
            if parent is not None:
                parent.children.append(b)
            assert not self.closing
            tg = self.handle.tasks if self.keeping else self.tg
            assert tg is not None
            self.branches.launch(b, tg)
            started.append(b)
        return started
