"""Whether a capture pays for the time it is held: pure functions over what the state tree knows of the siblings
that could still ask for a state, in the cost model every kept thing shares (``byte_seconds_net``).

A capture of state ``K`` serves a sibling that reaches ``K``: it skips the write's run time, so its rollout (and
the memory it holds) ends that much sooner. With ``release_unreachable`` the capture is held until the last
sibling that could reach ``K`` has passed it. It is taken only when

    expected askers x the write's seconds x a rollout's bytes >= the capture's bytes x expected hold

where a sibling standing ``d`` states above ``K`` asks for it with the share of the sessions that left its state
and went on to ``K`` (all of them while only the capturer did: a first use keeps the old rule), and is expected to
get there in ``(d - 1) x pace + max(pace / 4, pace - the seconds it has stood there)`` (``pace``: the mean seconds
between two state changes of a session, LLM turns and reads included; at least a quarter of one: a turn that runs
long tends to go on, as ``speculator.CostAwarePolicy.hideable`` assumes of LLM time).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .._workspace._accounting import byte_seconds_net

__all__ = ["Pace", "Waiter", "capture_net", "expected_askers", "expected_hold"]


class Waiter(msgspec.Struct, frozen=True):
    """Sessions that stand on one state above the captured one: ``distance`` state changes above it,
    ``sessions`` of them, ``follow`` the share (0..1) expected to go on to it, the last of them there for ``since``
    seconds."""

    distance: int
    sessions: int
    follow: float
    since: float


class Pace:
    """The mean seconds between two state changes of a session (every session of one cache): None until one was
    seen."""

    def __init__(self) -> None:
        self.total, self.n = 0.0, 0

    def observe(self, seconds: float) -> None:
        if seconds >= 0:
            self.total += seconds
            self.n += 1

    @property
    def value(self) -> float | None:
        return self.total / self.n if self.n else None


def expected_askers(waiters: Sequence[Waiter]) -> float:
    """How many sessions are expected to ask for the state."""
    return sum(w.sessions * w.follow for w in waiters)


def expected_hold(waiters: Sequence[Waiter], pace: float) -> float:
    """Seconds until the last of ``waiters`` is expected to have reached the state (see the module doc)."""
    return max(
        ((w.distance - 1) * pace + max(0.25 * pace, pace - w.since) for w in waiters if w.follow > 0), default=0.0
    )


def capture_net(
    waiters: Sequence[Waiter], pace: float, seconds_saved: float, rollout_bytes: float, capture_bytes: float
) -> float:
    """Byte-seconds a capture is expected to save, net of holding it (negative: it cannot pay): ``seconds_saved``
    the write's run time, ``rollout_bytes`` what a sibling's rollout holds, ``capture_bytes`` what the capture
    will."""
    hold = expected_hold(waiters, pace)
    return byte_seconds_net(expected_askers(waiters), seconds_saved, rollout_bytes, capture_bytes, hold)
