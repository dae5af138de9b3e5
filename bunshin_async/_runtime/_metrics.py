"""Per-turn and per-rollout speculation metrics, and the timeline of a turn (msgspec records)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

__all__ = ["BranchRecord", "EventKind", "RolloutMetrics", "TimelineEvent", "TurnLog", "TurnMetrics", "merge_counts"]

EventKind = Literal[
    "turn_start",
    "first_token",
    "tool_name",
    "arguments_complete",
    "message_finished",
    "stream_end",
    "branch_launch",
    "branch_ready",
    "branch_done",
    "branch_move",  # a write branch committed at the ask while its call still runs (the rollout moved into it)
    "branch_commit",
    "branch_discard",
    "branch_kept",
    "call_start",
    "call_done",
    "turn_end",
]


class TimelineEvent(msgspec.Struct, frozen=True, array_like=True):
    """``t``: seconds since the turn started; ``index``: the call (or branch position) it concerns, -1 if none."""

    t: float
    kind: EventKind
    index: int = -1
    detail: str = ""


class BranchRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One speculative branch. ``outcome``: ``committed`` (its result was used), ``wasted`` (a wrong prediction,
    or started too late to matter and discarded), ``failed`` (the fork or the run failed; the call ran normally).
    Seconds are wall time; ``cpu_seconds`` the fork's cgroup CPU time (wall time where not measurable);
    ``memory_bytes`` what the fork held (``_probes.fork_cost``); ``depth`` the speculated calls it was chained
    after (0: it ran from the rollout's state); ``probability`` that of the whole chain up to it."""

    position: int
    tool: str
    effect: str
    source: str
    probability: float
    outcome: Literal["committed", "wasted", "failed"]
    launched_at: float
    fork_seconds: float = 0.0
    run_seconds: float = 0.0
    cpu_seconds: float = 0.0
    memory_bytes: int = 0
    saved_seconds: float = 0.0
    depth: int = 0
    ahead: bool = False  # launched when the previous turn's last observation was known (``on_observation``)


class _Counts(msgspec.Struct, kw_only=True):
    """The counters a turn reports and a rollout sums."""

    calls: int = 0
    predicted: int = 0
    launched: int = 0
    paused: int = 0
    committed: int = 0
    wasted: int = 0
    failed: int = 0
    wasted_seconds: float = 0.0
    wasted_cpu_seconds: float = 0.0
    wasted_memory_bytes: int = 0
    fork_seconds: float = 0.0
    saved_seconds: float = 0.0
    launched_ahead: int = 0
    ahead_seconds: float = 0.0
    handover_seconds: float = 0.0
    llm_seconds: float = 0.0
    tool_seconds: float = 0.0
    #: Unused branches a turn could have kept for the next one and let go: the policy said keeping them could not
    #: pay (``Policy.keeps``).
    released: int = 0


class TurnMetrics(_Counts, kw_only=True):
    """One turn: ``predicted`` distinct candidates seen, ``launched`` branches, ``paused`` decision points at which
    the policy was not ``active`` (the predictors were not asked), ``committed`` (hits), ``wasted``
    ones with their cost, ``saved_seconds`` (tool time moved off the critical path, net of waiting for the branch),
    ``launched_ahead``: branches the previous turn launched for this turn's first call when its last observation
    was known (``Speculation.on_observation``), ``ahead_seconds`` the lead they had over a launch at this turn's
    start, ``llm_seconds`` (turn start to message end), ``tool_seconds`` (critical tool time after the message
    ended), ``turn_seconds`` (turn start to the last result) and ``handover_seconds`` (the last result to the turn's
    end: unused branches cancelled, settled or handed over; the next model request waits for it)."""

    turn: int = 0
    turn_seconds: float = 0.0
    branches: list[BranchRecord] = msgspec.field(default_factory=list)
    timeline: list[TimelineEvent] = msgspec.field(default_factory=list)


class RolloutMetrics(_Counts, kw_only=True):
    """Sums over a rollout's turns (``add`` one ``TurnMetrics`` per turn)."""

    turns: int = 0
    wall_seconds: float = 0.0

    def add(self, turn: TurnMetrics) -> None:
        self.turns += 1
        for name in _Counts.__struct_fields__:
            setattr(self, name, getattr(self, name) + getattr(turn, name))
        self.wall_seconds += turn.turn_seconds

    @property
    def hit_rate(self) -> float:
        """Committed branches per call made."""
        return self.committed / self.calls if self.calls else 0.0


def merge_counts(dst: _Counts, src: _Counts) -> None:
    """Add ``src``'s counters to ``dst``'s."""
    for name in _Counts.__struct_fields__:
        setattr(dst, name, getattr(dst, name) + getattr(src, name))


class TurnLog:
    """A turn's metrics and the clock its timeline is measured on, shared by the turn's parts (the stream, the main
    line, the branches: a kept branch records into the turn that owns it now). ``finalized``: the turn has ended
    and been summed into its rollout's metrics (what is counted afterwards must be added there too)."""

    def __init__(self, metrics: TurnMetrics, clock: Callable[[], float]) -> None:
        self.metrics, self.clock = metrics, clock
        self.t0 = clock()
        self.finalized = False

    def mark(self, kind: EventKind, index: int = -1, detail: str = "") -> None:
        self.metrics.timeline.append(TimelineEvent(self.clock() - self.t0, kind, index, detail))
