"""The cost-aware policy's decisions on constructed states: a group's straggler is preferred (group latency is
its straggler's), a chained launch pays with its chain's probability within the LLM time it can hide, and a
predictor's probabilities are scaled by how often its guesses were right."""

from __future__ import annotations

import msgspec
import pytest

from bunshin_async._tools import Effect, bash_tool
from bunshin_async.speculation import CallKey, Candidate, Launch
from speculator import CostAwarePolicy

BASH = bash_tool()


def _launch(
    rollout: str, progress: int, *, p: float = 0.6, seconds: float = 2.0, depth: int = 0, prior: float = 1.0
) -> Launch:
    command = f"make -C {rollout}"
    cand = Candidate(name="bash", arguments={"command": command}, probability=p, expected_seconds=seconds)
    return Launch(
        candidate=cand, key=CallKey.of(BASH, {"command": command}), effect=Effect.WRITE, rollout=rollout,
        progress=progress, depth=depth, prior=prior,
    )  # fmt: skip


def _group(policy: CostAwarePolicy, progress: dict[str, int]) -> None:
    """Tell ``policy`` where each rollout of the group is (what it learns from the launches it is asked about)."""
    for rollout, calls in progress.items():
        policy.select([_launch(rollout, calls, p=0.0)], running=0, forks=0)  # below min_probability: not launched


def test_the_group_straggler_gets_the_last_forks() -> None:
    policy = CostAwarePolicy(contention=None, group_forks=3, straggler_reserve=1, llm_seconds=3.0)
    _group(policy, {"a": 9, "b": 4, "c": 7})  # b is furthest behind
    assert policy.lag("b") == 1.0 and policy.lag("a") == 0.0 and policy.lag("c") == pytest.approx(0.4)
    # the same guess is worth more for the straggler: its saving shortens the group's latency
    assert policy.saving(_launch("b", 4)) > policy.saving(_launch("c", 7)) > policy.saving(_launch("a", 9))
    # two forks in flight for the front rollouts; the last one of the group's budget is the straggler's alone
    assert len(policy.select([_launch("a", 9)], running=0, forks=0)) == 1
    assert len(policy.select([_launch("c", 7)], running=0, forks=0)) == 1
    assert policy.select([_launch("a", 9)], running=0, forks=1) == []
    assert policy.select([_launch("c", 7)], running=0, forks=1) == []
    [taken] = policy.select([_launch("b", 4)], running=0, forks=0)
    assert taken.rollout == "b"
    assert policy.select([_launch("b", 4)], running=0, forks=1) == []  # the group budget is spent
    # a's branch ends: its fork goes back to the group, where the reserve still keeps it for the straggler
    policy.release(_launch("a", 9))
    assert policy.select([_launch("c", 7)], running=0, forks=1) == []
    assert len(policy.select([_launch("b", 4)], running=0, forks=1)) == 1
    policy.release(_launch("b", 4))
    policy.release(_launch("b", 4))
    assert len(policy.select([_launch("c", 7)], running=0, forks=1)) == 1
    # the straggler finishes: it no longer counts; c is now the one behind
    policy.rollout_done("b")
    assert policy.lag("c") == 1.0 and policy.lag("a") == 0.0


def test_a_lone_rollout_is_nobodys_straggler() -> None:
    policy = CostAwarePolicy(contention=None)
    _group(policy, {"solo": 3})
    assert policy.lag("solo") == 0.0
    assert policy.saving(_launch("solo", 3)) == pytest.approx(0.6 * 2.0 - 0.2)


def test_a_chained_launch_pays_with_its_chain_probability_within_the_llm_time_it_can_hide() -> None:
    policy = CostAwarePolicy(contention=None, llm_seconds=1.0, max_depth=2)
    one = _launch("r", 0, p=0.9, seconds=5.0)
    two = _launch("r", 0, p=0.9, seconds=5.0, depth=1, prior=0.9)
    assert two.probability == pytest.approx(0.81)
    assert policy.saving(one) == pytest.approx(0.9 * 1.0 - 0.2)  # at most this turn's LLM time
    assert policy.saving(two) == pytest.approx(0.81 * 2.0 - 0.2)  # this turn's and the next one's
    unlikely = _launch("r", 0, p=0.3, seconds=5.0, depth=1, prior=0.1)
    assert policy.select([unlikely], running=0, forks=0) == []  # 0.03: below min_probability
    too_deep = _launch("r", 0, p=1.0, seconds=5.0, depth=3)
    assert policy.select([too_deep], running=0, forks=0) == []


def test_a_predictor_that_never_matches_stops_launching_and_a_calibrated_one_keeps_its_odds() -> None:
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, prior_weight=2.0)
    guess = _launch("r", 0, p=0.9, seconds=2.0)  # source "": one predictor's guesses
    assert policy.probability(guess) == pytest.approx(0.9)  # nothing observed yet: taken at its word
    assert len(policy.select([guess], running=0, forks=0)) == 1
    for _ in range(20):  # twenty decided calls, none of them what it guessed
        policy.observe_prediction("", 0.9, False)
    assert policy.calibration("") == pytest.approx(2 / 20)
    assert policy.select([guess], running=0, forks=0) == []  # 0.09 x 2 s no longer pays for the fork
    # another predictor, right as often as it says (half of its 0.5 guesses hit): its odds are unchanged
    for i in range(40):
        policy.observe_prediction("fair", 0.5, i % 2 == 0)
    fair = Launch(
        candidate=msgspec.structs.replace(guess.candidate, probability=0.5, source="fair"), key=guess.key,
        effect=guess.effect, rollout="r",
    )  # fmt: skip
    assert policy.probability(fair) == pytest.approx(0.5)
    # an underconfident one is raised, never above 1; a chain's prior still multiplies it
    for _ in range(20):
        policy.observe_prediction("shy", 0.3, True)
    shy = msgspec.structs.replace(fair, candidate=msgspec.structs.replace(fair.candidate, source="shy"), prior=0.5)
    assert policy.calibration("shy") == pytest.approx(22 / 8) and policy.probability(shy) == pytest.approx(0.5)
