"""When a group forks its set-up (pure: no workspace)."""

from __future__ import annotations

import pytest

from bunshin_async import InvalidValue
from bunshin_async.rollout import ForkRule, GroupRollout, RolloutContext, Task, Trajectory

pytestmark = pytest.mark.unit

MIB = 1 << 20


@pytest.mark.parametrize(
    ("setup_seconds", "extra_bytes", "pays"),
    [
        (0.0, 0, False),  # nothing set up: a fork would only add its dump, restore and page image
        (0.49, 15 * MIB, False),  # cheap and small: every rollout repeats it instead
        (0.5, 0, True),  # the set-up costs at least what a fork does
        (30.0, 0, True),
        (0.01, 16 * MIB, True),  # enough memory for sharing it to matter
        (0.01, -MIB, False),  # a base smaller after its set-up than fresh (freed caches) holds nothing extra
    ],
)
def test_the_default_rule(setup_seconds: float, extra_bytes: int, pays: bool) -> None:
    assert ForkRule().pays(setup_seconds, extra_bytes) is pays


def test_each_threshold_is_a_parameter() -> None:
    assert ForkRule(min_setup_seconds=2.0).pays(1.0, 0) is False
    assert ForkRule(min_setup_seconds=0.0).pays(0.0, 0) is True
    assert ForkRule(min_extra_bytes=64 * MIB).pays(0.0, 32 * MIB) is False
    assert ForkRule(min_extra_bytes=MIB).pays(0.0, MIB) is True


@pytest.mark.parametrize(
    ("n", "setup_seconds", "extra_bytes", "pays"),
    [
        (2, 0.3, 0, False),  # a pair: one set-up spared does not pay for the dump and two restores
        (3, 0.3, 0, True),  # two spared pay for the dump and three restores (0.6 s)
        (3, 0.29, 0, False),
        (16, 0.13, 0, True),  # fifteen spared: 1.95 s against 0.3 + 16 x 0.1
        (16, 0.12, 0, False),
        (64, 0.1, 0, False),  # however large the group, a set-up no longer than a restore is never forked
        (2, 0.0, 8 * MIB, False),  # one copy's duplicate of 8 MiB is not worth the fork
        (3, 0.0, 8 * MIB, True),  # two copies' are (16 MiB not held twice over)
        (16, 0.0, 2 * MIB, True),
        (16, 0.0, MIB, False),
        (1, 30.0, 1 << 30, False),  # a group of one spares nothing
    ],
)
def test_what_a_fork_spares_grows_with_the_group(n: int, setup_seconds: float, extra_bytes: int, pays: bool) -> None:
    assert ForkRule().pays(setup_seconds, extra_bytes, n) is pays


def test_a_group_of_two_is_the_thresholds_own_case() -> None:
    rule = ForkRule(min_setup_seconds=1.0, min_extra_bytes=4 * MIB, restore_seconds=0.2)
    assert rule.pays(1.0, 0) is rule.pays(1.0, 0, 2) is True and rule.pays(0.99, 0, 2) is False
    assert rule.pays(0.0, 4 * MIB, 2) is True and rule.pays(0.0, 4 * MIB - 1, 2) is False
    assert rule.pays(0.6, 0, 3) is True and rule.pays(0.59, 0, 3) is False  # 2 x 0.6 >= 1.0 + 0.2


class _Agent:
    async def run(self, ctx: RolloutContext) -> Trajectory:
        raise AssertionError("never run")


def test_fork_is_true_false_or_always() -> None:
    task = Task(task_id="t", prompt="", setup=["true"])
    assert GroupRollout(task, 2, _Agent(), fork=False).forked is False
    assert GroupRollout(task, 2, _Agent()).forked is None  # decided after the set-up
    assert GroupRollout(task, 2, _Agent(), fork="always").forked is None
    with pytest.raises(InvalidValue) as info:
        GroupRollout(task, 2, _Agent(), fork="auto")  # type: ignore[arg-type]
    assert info.value.argument == "fork"


@pytest.mark.parametrize(
    "prepares",
    [{"files": {"a": b"x"}}, {"setup": ["true"]}, {"background": ["sleep 1"]}, {"ready": ["true"]}],
)
def test_a_group_decides_up_front_only_when_nothing_can_be_shared(prepares: dict[str, object]) -> None:
    """A task that prepares nothing, or a group of one, has nothing a fork could share: the group runs the
    baseline's path from the start (every rollout fresh at once), not a base that the others wait for."""
    bare = Task(task_id="t", prompt="")
    assert GroupRollout(bare, 4, _Agent()).forked is False
    assert GroupRollout(bare, 4, _Agent(), fork="always").forked is None  # forced: forks the bare image
    task = Task(task_id="t", prompt="", **prepares)  # type: ignore[arg-type]
    assert GroupRollout(task, 4, _Agent()).forked is None  # decided after the set-up, by the rule
    assert GroupRollout(task, 1, _Agent()).forked is False
