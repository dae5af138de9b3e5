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
