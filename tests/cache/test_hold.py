"""The capture rule in byte-seconds (``_cache/_hold``): who may still ask for a state (``StateTree.waiters``), how
long a capture would be held for them, and whether the seconds they are spared pay for it. Pure: no workspace."""

from __future__ import annotations

import pytest

from bunshin_async._cache._hold import Pace, Waiter, capture_net, expected_askers, expected_hold
from bunshin_async._cache._state import StateTree
from bunshin_async.rollout import byte_seconds_net

pytestmark = pytest.mark.unit

MIB = 1 << 20
ROOT, S1, S2, S3 = b"r" * 16, b"1" * 16, b"2" * 16, b"3" * 16


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_cost_model_weighs_bytes_freed_sooner_against_bytes_held() -> None:
    # 2 users x 3 s sooner x 64 MiB against 32 MiB held 10 s
    assert byte_seconds_net(2, 3.0, 64 * MIB, 32 * MIB, 10.0) == pytest.approx((2 * 3 * 64 - 32 * 10) * MIB)
    assert byte_seconds_net(2, 3.0, 64 * MIB, 32 * MIB, 10.0, weight=0.0) == pytest.approx(2 * 3 * 64 * MIB)


def test_waiters_are_the_sessions_above_a_state_with_the_share_that_went_on_to_it() -> None:
    clock = Clock()
    tree = StateTree(1 << 30, release_unreachable=True, clock=clock)
    for _ in range(4):  # four sessions open on the base at t=0
        tree.pin(ROOT)
    clock.t = 10.0
    tree.pin(S1, ROOT)  # the first writes and moves on
    tree.unpin(ROOT)
    # three wait one write above; the only one that left went on to S1 (a first use: the old rule, all may come)
    assert tree.waiters(S1) == [Waiter(distance=1, sessions=3, follow=1.0, since=10.0)]
    clock.t = 12.0
    tree.pin(S2, ROOT)  # the second makes another write
    tree.unpin(ROOT)
    assert tree.waiters(S2) == [Waiter(1, 2, 0.5, 12.0)]  # of two that left, one came here
    tree.pin(S3, S2)  # and a second one after it: the two at the base are two writes above
    tree.unpin(S2)
    assert tree.waiters(S3) == [Waiter(2, 2, 0.5, 12.0)]
    # a restore holds the state it restores without arriving there: not a visit
    tree.pin(S1, ROOT, visit=False)
    tree.unpin(S1, visit=False)
    assert tree.waiters(S1) == [Waiter(1, 2, pytest.approx(1 / 2), 12.0)]
    clock.t = 13.0
    tree.pin(ROOT)  # a session arriving at the base now: the last of them has stood there 0 s
    assert tree.waiters(S1)[0].since == 0.0
    assert tree.waiters(b"x" * 16) == []


def test_the_hold_lasts_until_the_last_waiter_is_expected_to_arrive() -> None:
    pace = 10.0
    near = Waiter(distance=1, sessions=2, follow=1.0, since=4.0)  # 6 s of its pace left
    assert expected_hold([near], pace) == pytest.approx(6.0)
    late = Waiter(distance=1, sessions=1, follow=1.0, since=30.0)  # overdue: still a quarter of a pace
    assert expected_hold([late], pace) == pytest.approx(2.5)
    behind = Waiter(distance=3, sessions=1, follow=0.5, since=0.0)  # a straggler three writes behind
    assert expected_hold([near, behind], pace) == pytest.approx(30.0)
    assert expected_hold([Waiter(3, 1, 0.0, 0.0)], pace) == 0.0  # nobody there goes this way
    assert expected_askers([near, behind]) == pytest.approx(2.5)


def test_a_capture_is_taken_only_when_its_reuse_pays_for_its_hold() -> None:
    """Two siblings one write behind, each spared a 2 s write, a rollout and a capture of 16 MiB: held 1 s it pays
    (2 x 2 > 1), held until a straggler three long LLM turns behind arrives it does not; a capture a tenth of the
    rollout's size pays for a 30 s hold (2.5 x 2 x 16 > 1.6 x 30) where one its size does not."""
    close = [Waiter(1, 2, 1.0, since=9.0)]
    assert expected_hold(close, 10.0) == pytest.approx(2.5)
    assert capture_net(close, 10.0, 2.0, 16 * MIB, 16 * MIB) == pytest.approx((2 * 2 - 2.5) * 16 * MIB)
    straggler = [*close, Waiter(3, 1, 0.5, since=0.0)]
    assert capture_net(straggler, 10.0, 2.0, 16 * MIB, 16 * MIB) < 0
    assert capture_net(straggler, 10.0, 2.0, 16 * MIB, 1.6 * MIB) > 0


def test_pace_is_unknown_until_a_session_moved() -> None:
    pace = Pace()
    assert pace.value is None
    pace.observe(2.0)
    pace.observe(4.0)
    assert pace.value == pytest.approx(3.0)
