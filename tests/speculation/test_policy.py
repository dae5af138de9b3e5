"""The cost-aware policy's decisions on constructed states: a group's straggler is preferred (group latency is
its straggler's), a chained launch pays with its chain's probability within the LLM time it can hide, and a
predictor's probabilities are scaled by how often its guesses were right, a wrong guess is charged the memory its fork
holds, and the per-call run times kept are bounded."""

from __future__ import annotations

import msgspec
import pytest

from bunshin_async._tools._tools import Effect, bash_tool
from bunshin_async.speculation import CallKey, Candidate, Launch
from speculator import CostAwarePolicy, Decision, Verdict
from speculator._signature import key_signature

pytestmark = pytest.mark.unit

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


def _call_measured(policy: CostAwarePolicy) -> None:
    """A fork's call has been measured (``observe_fork_call``): a ``true`` that raised nothing, so a ``make``
    (never run in a fork nor on the main line) is charged nothing for its call (any signature's bytes: 0)."""
    policy.observe_fork_call(CallKey.of(BASH, {"command": "true"}), 0.01, 0)


def _group(policy: CostAwarePolicy, progress: dict[str, int]) -> None:
    """Tell ``policy`` where each rollout of the group is (what it learns from the launches it is asked about)."""
    for rollout, calls in progress.items():
        policy.select([_launch(rollout, calls, p=0.0)], running=0, forks=0)  # below min_probability: not launched


def test_the_group_straggler_gets_the_last_forks() -> None:
    policy = CostAwarePolicy(contention=None, group_forks=3, straggler_reserve=1, llm_seconds=3.0, memory_weight=0)
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
    policy.release(_launch("a", 9), True)
    assert policy.select([_launch("c", 7)], running=0, forks=1) == []
    assert len(policy.select([_launch("b", 4)], running=0, forks=1)) == 1
    policy.release(_launch("b", 4), True)
    policy.release(_launch("b", 4), True)
    assert len(policy.select([_launch("c", 7)], running=0, forks=1)) == 1
    # the straggler finishes: it no longer counts; c is now the one behind
    policy.rollout_done("b")
    assert policy.lag("c") == 1.0 and policy.lag("a") == 0.0


def test_the_straggler_is_its_own_groups_and_a_group_of_one_has_none() -> None:
    """One policy shared by several groups (the experiment's): lag is measured among a rollout's own group, so the
    rollouts of groups of one (the SWE replay) never count as stragglers of the others."""
    policy = CostAwarePolicy(contention=None)
    for rollout, group, calls in (("a0", "a", 9), ("a1", "a", 3), ("b0", "b", 1), ("c0", "c", 20)):
        launch = msgspec.structs.replace(_launch(rollout, calls, p=0.0), group=group)
        policy.select([launch], running=0, forks=0)
    assert policy.lag("a1") == 1.0 and policy.lag("a0") == 0.0
    assert policy.lag("b0") == 0.0 and policy.lag("c0") == 0.0  # alone in their groups, however far behind
    # the last rollout of a group whose siblings ended is its straggler: the group waits for it alone
    policy.rollout_done("a1")
    assert policy.lag("a0") == 1.0
    assert policy.saving(_launch("a0", 9)) > policy.saving(_launch("c0", 20))


def test_a_group_is_forgotten_with_its_last_rollout() -> None:
    """A training run makes groups without end: the policy keeps nothing of a group whose rollouts all ended (its
    most-at-once count stayed, one more a step: review 21)."""
    policy = CostAwarePolicy(contention=None)
    for step in range(50):
        rollouts = {f"s{step}r{i}": calls for i, calls in enumerate((3, 5, 4))}
        for rollout, calls in rollouts.items():
            policy.select(
                [msgspec.structs.replace(_launch(rollout, calls, p=0.0), group=f"g{step}")], running=0, forks=0
            )
        for rollout in rollouts:
            policy.rollout_done(rollout)
    assert not policy._progress.size and not policy._progress.group and not policy._progress.calls


def test_a_lone_rollout_is_nobodys_straggler() -> None:
    policy = CostAwarePolicy(contention=None)
    _group(policy, {"solo": 3})
    assert policy.lag("solo") == 0.0
    # the gain, less the fork's time (its memory is weighed apart, in GiB·s: memory_net)
    assert policy.saving(_launch("solo", 3)) == pytest.approx(0.6 * 2.0 - 0.2)


def test_a_chained_launch_pays_with_its_chain_probability_within_the_llm_time_it_can_hide() -> None:
    policy = CostAwarePolicy(contention=None, llm_seconds=1.0, max_depth=2, memory_weight=0)
    one = _launch("r", 0, p=0.9, seconds=5.0)
    two = _launch("r", 0, p=0.9, seconds=5.0, depth=1, prior=0.9)
    assert two.probability == pytest.approx(0.81)
    # at most this turn's LLM time
    assert policy.saving(one) == pytest.approx(0.9 * 1.0 - 0.2)
    assert policy.saving(two) == pytest.approx(0.81 * 2.0 - 0.2)  # this turn's and the next one's
    # its fork is held until the model asks for its call, this turn and the next (a hit is committed then, its call
    # still running or not; a miss still running is cancelled then), not until its 5 s call ends
    assert policy.hold_seconds(two) == pytest.approx(0.2 + 1.0 + 1.0)
    unlikely = _launch("r", 0, p=0.3, seconds=5.0, depth=1, prior=0.1)
    assert policy.select([unlikely], running=0, forks=0) == []  # 0.03: below min_probability
    too_deep = _launch("r", 0, p=1.0, seconds=5.0, depth=3)
    assert policy.select([too_deep], running=0, forks=0) == []


def test_a_predictor_that_never_matches_stops_launching_and_a_calibrated_one_keeps_its_odds() -> None:
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, prior_weight=2.0, memory_weight=0)
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
    # a chain through its parent: the parent's odds calibrated too (a shy predictor's write, then a fair guess)
    parent = msgspec.structs.replace(shy, prior=1.0)
    child = msgspec.structs.replace(fair, depth=1, prior=parent.probability, parent=parent)
    assert child.probability == pytest.approx(0.5 * 0.5)  # as predicted
    assert policy.probability(child) == pytest.approx(1.0 * 0.5)  # as calibrated: the shy parent is ~certain


def test_a_predictor_whose_launched_guesses_are_never_used_stops_launching() -> None:
    """Calibrated over all its guesses (the cheap, cache-served ones hit), but the ones it bets on never do."""
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, prior_weight=2.0)
    for i in range(100):
        policy.observe_prediction("", 0.5, i % 2 == 0)
    guess = msgspec.structs.replace(_launch("r", 0, p=0.5, seconds=2.0), effect=Effect.READ)
    assert policy.calibration("") == pytest.approx(1.0)
    assert policy.select([guess], running=0, forks=0) == [guess]
    for _ in range(8):  # eight launches of its 50% guesses, none used: 4 expected
        policy.release(guess, False)
    assert policy.calibration("") == pytest.approx(2 / 6)  # (0 used + 2 x 1.0) / (4 expected + 2)
    assert policy.probability(guess) == pytest.approx(0.5 / 3)
    # the launched record only shrinks towards all guesses': as many used as expected restores the odds
    for _ in range(8):
        policy.release(guess, True)
    assert policy.calibration("") == pytest.approx((8 + 2) / (8 + 2))


def test_a_fork_is_launched_only_when_the_gib_seconds_it_saves_pay_for_what_it_holds() -> None:
    """A fork exists beside its rollout from its launch until the model asks for its call, hit or miss (a hit is
    committed then even while its call runs on); a hit frees the rollout's memory the hidden seconds sooner.
    Byte-seconds, the experiment's currency."""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.0)
    policy.observe_rollout_memory(64 * mib)
    _call_measured(policy)
    policy.observe_fork(0.2, 64 * mib)  # a copy-on-write fork holds an image of its whole rollout
    sure = _launch("r", 0, p=1.0, seconds=2.0)
    # hides its 2 s run, but is held 0.2 s (the fork) + 3 s (until the model asks for it): 2 x 64 < 3.2 x 64
    assert policy.hold_seconds(sure) == pytest.approx(3.2)
    assert policy.memory_net(sure) == pytest.approx((1.0 * 2.0 - 3.2) * 64 * mib)
    assert policy.saving(sure) > 0 and policy.select([sure], running=0, forks=0) == []  # saves time, not GiB·s
    in_place = msgspec.structs.replace(sure, effect=Effect.READ)
    assert policy.select([in_place], running=0, forks=0) == [in_place]  # a read holds no fork
    # a run as long as the turn: held about as long as it hides; a sure guess then pays, a likely one does not
    long = _launch("r", 0, p=1.0, seconds=3.0)
    assert policy.memory_net(long) == pytest.approx((3.0 - 3.2) * 64 * mib)
    policy.observe_fork(0.2, 32 * mib)  # forks half the rollout's size (running average: 0.7 x 64 + 0.3 x 32)
    assert policy.memory_net(long) > 0 and len(policy.select([long], running=0, forks=0)) == 1
    assert policy.select([_launch("r", 0, p=0.6, seconds=3.0)], running=0, forks=0) == []
    # a call far longer than the turn (a 28 s install): held only until the ask (the rollout then moves into the
    # fork), not until it ends: it hides the 3 s the turn has left for 3.2 s of holding 54.4 MiB
    install = _launch("r", 0, p=1.0, seconds=28.0)
    assert policy.hold_seconds(install) == pytest.approx(3.2)
    assert policy.memory_net(install) == pytest.approx((3.0 * 64 - 3.2 * (0.7 * 64 + 0.3 * 32)) * mib)
    assert policy.select([install], running=0, forks=0) == [install]
    # long LLM turns on a small workspace: held for the whole turn, hiding only the run: never
    slow_model = CostAwarePolicy(contention=None, llm_seconds=30.0, fork_seconds=0.2, memory_share=0.0)
    slow_model.observe_rollout_memory(16 * mib)
    _call_measured(slow_model)
    slow_model.observe_fork(0.2, 16 * mib)
    assert slow_model.select([_launch("r", 0, p=1.0, seconds=2.0)], running=0, forks=0) == []
    # a group's straggler finishing sooner frees more than its own workspace (its group's base and captures)
    group = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, group_forks=4, memory_share=0.0)
    group.observe_rollout_memory(64 * mib)
    _call_measured(group)
    group.observe_fork(0.2, 60 * mib)
    _group(group, {"front": 9, "behind": 4})
    assert group.select([_launch("front", 9, p=0.9, seconds=3.0)], running=0, forks=0) == []
    assert len(group.select([_launch("behind", 4, p=0.9, seconds=3.0)], running=0, forks=0)) == 1


def test_a_hit_is_charged_what_its_copy_holds_beyond_the_rollout_until_the_rollout_ends() -> None:
    """A hit leaves the rollout the fork's copy for the rest of its life: what the copy holds more than the rollout
    did (measured in pairs, ``observe_copy``) is charged, times the hit's probability, over the rollout's expected
    remaining time: as long again as it has run until a rollout ended (at least ``rollout_seconds``), then the
    ended ones' mean less its elapsed time (at least a quarter of that mean). A copy smaller than its rollout saves
    the difference as long (by the kernel's counters a first copy of a small workspace holds less than the fresh
    workspace it replaces, to the rollout's end), but only once: a rollout living in a copy is weighed with what
    copies of copies hold."""
    mib, now = 1 << 20, [0.0]
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, rollout_seconds=60.0, memory_share=0.0,
                             clock=lambda: now[0])  # fmt: skip
    policy.observe_rollout_memory(16 * mib)
    _call_measured(policy)
    policy.observe_fork(0.2, 8 * mib)
    sure = _launch("r", 1, p=1.0, seconds=3.0)
    held = (1.0 * 3.0 * 16 - 3.2 * 8) * mib  # hides 3 s of a 16 MiB rollout, holds 8 MiB for 3.2 s
    assert policy.memory_net(sure) == pytest.approx(held)  # nothing measured: a copy is taken to hold no more
    policy.observe_copy(24 * mib, 16 * mib)  # a copy 8 MiB bigger than its rollout
    assert policy.memory_net(sure) == pytest.approx(held - 8 * mib * 60.0)  # never seen: the prior, 60 s
    assert policy.select([sure], running=0, forks=0) == []
    _group(policy, {"r": 1})  # both start now, "other" in a group of its own ("r" alone: no straggler)
    policy.select([msgspec.structs.replace(_launch("other", 0, p=0.0), group="o")], running=0, forks=0)
    now[0] = 10.0
    assert policy.memory_net(sure) == pytest.approx(held - 8 * mib * 50.0)  # 60 s in all, 10 s run
    now[0] = 100.0
    assert policy.memory_net(sure) == pytest.approx(held - 8 * mib * 100.0)  # as long again as it has run
    unlikely = _launch("r", 1, p=0.5, seconds=3.0)
    assert policy.memory_net(unlikely) == pytest.approx((0.5 * 3.0 * 16 - 3.2 * 8 - 0.5 * 8 * 100.0) * mib)
    policy.rollout_done("other")  # ended after 100 s: the mean
    now[0] = 110.0
    assert policy.memory_net(sure) == pytest.approx(held - 8 * mib * 25.0)  # past the mean: a quarter of it
    assert CostAwarePolicy(contention=None, memory_weight=0.0).memory_net(sure) > 0  # memory not weighed
    for _ in range(20):  # first copies turn out 8 MiB smaller than their rollouts: a hit saves that to the end
        policy.observe_copy(8 * mib, 16 * mib)
    extra = policy.copy_extra.value  # a running average: -8 MiB nearly
    assert extra == pytest.approx(-8 * mib, rel=0.01)
    assert policy.memory_net(sure) == pytest.approx(held - extra * 25.0)
    assert policy.select([sure], running=0, forks=0) == [sure]

    # its own pair counts for the rollout (its fork beside it, before the call): what its forks hold, what it holds
    # and what its copy would hold more or less
    def net(fork: float, rollout: float, extra: float) -> float:
        return (1.0 * 3.0 * rollout - 3.2 * fork - extra * 25.0) * mib

    policy.observe_copy(12 * mib, 16 * mib, "r")
    assert policy.memory_net(sure) == pytest.approx(net(12, 16, -4))
    # the hit: "r" lives in a copy now; what copies of copies hold (nothing measured: as much) is what counts
    policy.release(sure, True)
    assert policy.memory_net(sure) == pytest.approx(net(12, 16, 0))
    policy.observe_copy(40 * mib, 36 * mib, "r")  # it started a server: its forks copy it; its copy holds more
    assert policy.memory_net(sure) == pytest.approx(net(40, 36, 4))
    others = _launch("q", 1, p=1.0, seconds=3.0)  # a rollout never forked: the run's averages, the prior 60 s
    assert policy.memory_net(others) == pytest.approx(held - policy.copy_extra.value * 60.0)
    assert policy.memory.copied_extra.value == pytest.approx(4 * mib)  # the first copies' mean is left alone


def test_a_miss_is_charged_what_its_call_held_and_a_hit_is_not() -> None:
    """A fork is measured before its call (``observe_fork``); a discarded one again at its end, with what its call
    held (``observe_miss``). Until the ask a miss holds its fork, and its call's memory while the call runs (at most
    until the ask, when a miss still running is cancelled); a hit's call holds the same memory on the main line,
    only earlier, so the fork is charged it in proportion to the chance of a miss, for the call's expected run."""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.0)
    policy.observe_rollout_memory(16 * mib)
    _call_measured(policy)
    policy.observe_fork(0.2, 4 * mib)
    sure, even = _launch("r", 0, p=1.0, seconds=3.0), _launch("r", 0, p=0.5, seconds=3.0)
    assert policy.memory_net(sure) == pytest.approx((3.0 * 16 - 3.2 * 4) * mib)
    assert policy.memory_net(even) == pytest.approx((0.5 * 3.0 * 16 - 3.2 * 4) * mib)
    policy.observe_miss(24 * mib)  # a discarded fork held 20 MiB more: its call's
    assert policy.fork_bytes.value == 4 * mib  # what a fork holds of its own is unchanged
    assert policy.memory_net(sure) == pytest.approx((3.0 * 16 - 3.2 * 4) * mib)
    assert policy.memory_net(even) == pytest.approx((0.5 * 3.0 * 16 - 3.2 * 4 - 0.5 * 20 * 3.0) * mib)
    assert policy.select([even], running=0, forks=0) == [] and policy.select([sure], running=0, forks=0) == [sure]
    # a short call runs a fraction of the hold: a miss holds its memory only that long
    short = _launch("r", 0, p=0.5, seconds=0.5)
    assert policy.memory_net(short) == pytest.approx((0.5 * 0.5 * 16 - 3.2 * 4 - 0.5 * 20 * 0.5) * mib)


def test_before_anything_is_measured_forks_launch_one_at_a_time() -> None:
    """Until a fork and its rollout have been measured (when a fork is ready, before its call) their bytes are a
    prior, and the rule compares a prior with itself: with fork and rollout both taken to be 32 MiB, a fork can
    only pay when it hides more than it is held, which no fork does, so none launched and none was ever measured
    (issue 38, session 18: on the real traces the first fork launched 45 s into the run, a straggler's). So the
    first fork that pays in time is launched unweighed, one at a time until a measurement arrives; then the rule
    applies, in both directions."""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.0)
    likely, other = _launch("a", 0, p=0.6, seconds=2.0), _launch("b", 0, p=0.6, seconds=2.0)
    assert policy.memory_net(likely) < 0  # by the priors it could never pay
    assert policy.select([likely, other], running=0, forks=0) == [likely]  # one, to measure
    assert policy.select([other], running=0, forks=0) == []  # the first still unmeasured
    assert policy.verdicts["measuring"] == 2
    policy.observe_fork(0.2, 1 * mib)
    policy.observe_rollout_memory(4 * mib)  # measured beside it: the rule, as measured
    _call_measured(policy)
    assert policy.memory_net(other) > 0 and policy.select([other], running=0, forks=0) == [other]
    big = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.0)
    assert big.select([likely], running=0, forks=0) == [likely]
    big.observe_fork(0.2, 64 * mib)
    big.observe_rollout_memory(64 * mib)
    _call_measured(big)
    big.release(likely, False)
    assert big.select([other], running=0, forks=0) == []  # measured: as big as its rollout, it cannot pay
    assert big.verdicts["memory"] == 1
    unweighed = CostAwarePolicy(contention=None, llm_seconds=3.0, memory_weight=0.0)
    assert unweighed.select([likely, other], running=0, forks=0) == [likely, other]  # no rule, nothing to measure


def test_every_option_gets_one_decision_with_the_rule_that_refused_it() -> None:
    """``decisions`` (the experiment's ``--decisions``) is told each option's verdict, the first rule that refused
    it in ``select``'s order, with the figures that rule weighed."""
    mib = 1 << 20
    seen: list[Decision] = []
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, max_branches=2, decisions=seen.append)
    policy.observe_fork(0.2, 32 * mib)
    policy.observe_rollout_memory(16 * mib)
    _call_measured(policy)
    read = msgspec.structs.replace(_launch("r", 0, p=0.9, seconds=1.0), effect=Effect.READ)
    later = msgspec.structs.replace(_launch("v", 0, p=0.9, seconds=0.5), effect=Effect.READ)
    fork = _launch("s", 0, p=0.9, seconds=2.0)  # the best saving, but a fork twice its rollout's size
    unlikely = _launch("t", 0, p=0.01)
    short = _launch("u", 0, p=0.9, seconds=0.01)
    assert policy.select([later, read, fork, unlikely, short], running=1, forks=0) == [read]
    verdicts = {d.rollout: d.verdict for d in seen}
    assert verdicts == {
        "s": Verdict.MEMORY, "r": Verdict.LAUNCH, "v": Verdict.BRANCHES, "t": Verdict.PROBABILITY, "u": Verdict.SAVING,
    }  # fmt: skip
    d = seen[0]
    assert d.rollout == "s" and d.memory is not None and d.memory_net is not None and d.memory_net < 0
    assert d.memory.held == 32 * mib and d.memory.freed == pytest.approx(
        0.9 * 2.0 * 16 * mib * 2
    )  # all level: each a straggler
    assert d.call == "bash: make -C s" and d.fork and d.p == pytest.approx(0.9)
    assert policy.verdicts == {"launch": 1, "branches": 1, "probability": 1, "saving": 1, "memory": 1}
    assert not policy.keeps(fork) and seen[-1].verdict is Verdict.RELEASE and seen[-1].turn_elapsed == 0.0


def test_an_unused_branch_is_kept_for_the_next_turn_only_while_its_hold_pays() -> None:
    """A branch kept past its turn is asked for a turn later at the earliest: it holds its fork for at least the next
    turn's LLM time, whatever it hides. Late in a turn a long call may have been worth launching; kept into a new
    turn it is let go unless what it hides pays for a whole turn's hold."""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2)
    policy.observe_rollout_memory(64 * mib)
    _call_measured(policy)
    policy.observe_fork(0.2, 16 * mib)
    late = msgspec.structs.replace(_launch("r", 0, p=1.0, seconds=1.0), turn_elapsed=2.9)
    # launched 2.9 s into a 3 s turn (a quarter of a turn left, at least): 0.75 s hidden x 64 MiB against
    # 0.2 + 0.75 = 0.95 s x 16 MiB held (until the ask: a hit whose call runs on is committed then): pays
    assert policy.memory_net(late) == pytest.approx((0.75 * 64 - 0.95 * 16) * mib)
    assert policy.select([late], running=0, forks=0) == [late]
    # unused when the turn ended: a new turn holds it 0.2 + 3 s and it hides its whole 1 s: 64 > 3.2 x 16 pays
    assert policy.keeps(late)
    policy.observe_fork(0.2, 80 * mib)  # forks turn out bigger (0.7 x 16 + 0.3 x 80 = 35.2 MiB): it no longer does
    assert policy.memory_net(late) > 0 and not policy.keeps(late)
    assert CostAwarePolicy(contention=None, memory_weight=0.0).keeps(late)  # memory not weighed: kept as before


def test_a_read_in_the_rollouts_workspace_is_kept_whatever_forks_cost() -> None:
    """A read that runs in place holds no fork: keeping it for the next turn costs no byte-seconds (``select``
    launches it without weighing memory), where a read chained after a write holds that write's fork."""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2)
    policy.observe_rollout_memory(16 * mib)
    _call_measured(policy)
    policy.observe_fork(0.2, 80 * mib)  # forks far bigger than what a hit frees in a turn
    read = msgspec.structs.replace(_launch("r", 0, p=0.9, seconds=0.1), effect=Effect.READ)
    assert policy.select([read], running=0, forks=0) == [read]
    assert policy.keeps(read)
    write = _launch("r", 0, p=0.9, seconds=0.1)
    assert not policy.keeps(write)
    chained = msgspec.structs.replace(read, parent=write, depth=1)
    assert not policy.keeps(chained)


def test_the_run_times_kept_are_the_last_calls_run() -> None:
    policy = CostAwarePolicy(contention=None, max_calls=3, default_seconds=0.3)
    launches = [_launch(f"r{i}", 0) for i in range(4)]
    for i, launch in enumerate(launches):
        policy.observe_tool(launch.key, 10.0 + i)
    policy.observe_tool(launches[1].key, 11.0)  # run again: the most recent now
    policy.observe_tool(launches[0].key, 10.0)  # back in: the oldest of the others goes
    # r2, the least recently run, is forgotten: it falls back to its signature's ("bash:make") running average
    sig = 10.0
    for x in (11.0, 12.0, 13.0, 11.0, 10.0):
        sig = 0.7 * sig + 0.3 * x
    assert [policy.expected_seconds(launch) for launch in launches] == pytest.approx([10.0, 11.0, sig, 13.0])


def test_under_contention_a_call_that_waits_costs_less_than_one_that_computes() -> None:
    """The CPU a wrong guess takes from the other rollouts is its run time times the CPU share its signature was
    measured at on the main line: a coin-flip install that waits on the network pays, a coin-flip build does not."""
    policy = CostAwarePolicy(contention=lambda: 1.0, memory_weight=0.0)
    coin = _launch("a", 1, p=0.5, seconds=2.0)
    assert policy.cpu_share(coin) == 1.0 and policy.select([coin], running=0, forks=0) == []  # unmeasured: a CPU
    policy.observe_cpu(coin.key, 0.1, 2.0)
    assert policy.cpu_share(coin) == pytest.approx(0.05)
    assert policy.select([coin], running=0, forks=0) == [coin]
    cand = Candidate(name="bash", arguments={"command": "cc -O2 x.c"}, probability=0.5, expected_seconds=2.0)
    busy = Launch(candidate=cand, key=CallKey.of(BASH, {"command": "cc -O2 x.c"}), effect=Effect.WRITE)  # its own
    policy.observe_cpu(busy.key, 1.9, 2.0)
    assert policy.select([busy], running=0, forks=0) == []
    policy.observe_cpu(busy.key, 5.0, 0.01)  # too short to say anything
    assert policy.cpu_share(busy) == pytest.approx(0.95)


def test_a_long_shot_that_computes_is_not_launched_on_an_idle_machine_where_calls_are_short() -> None:
    """The SWE replay's case: reads of 30 ms that compute (``cat``, ``grep``), guesses right one time in four, turns
    under a second: what a hit hides (p x 30 ms) does not pay for the CPU the misses burn, even when the run queue is
    empty at the moment of the decision; a likely guess, and a long shot that waits, still launch."""

    def read(command: str, p: float) -> Launch:
        cand = Candidate(name="bash", arguments={"command": command}, probability=p)
        return Launch(candidate=cand, key=CallKey.of(BASH, {"command": command}), effect=Effect.READ)

    policy = CostAwarePolicy(contention=lambda: 0.0, llm_seconds=0.65, memory_weight=0.0)
    long_shot, likely = read("cat astropy/table/table.py", 0.25), read("cat astropy/io/fits/card.py", 0.9)
    for launch in (long_shot, likely):
        policy.observe_tool(launch.key, 0.03)
        policy.observe_cpu(launch.key, 0.03, 0.06)  # a 30 ms call at a full CPU (measured over a longer one)
    assert policy.select([long_shot], running=0, forks=0) == []
    assert policy.select([likely], running=0, forks=0) == [likely]
    # where turns last seconds, a long shot that waits (an install on the network) hides seconds and burns little
    # CPU: it pays; one as long that computes does not
    slow_turns = CostAwarePolicy(contention=lambda: 0.0, llm_seconds=3.0, memory_weight=0.0)
    install, build = (
        Launch(
            candidate=Candidate(name="bash", arguments={"command": c}, probability=0.25, expected_seconds=4.0),
            key=CallKey.of(BASH, {"command": c}), effect=Effect.WRITE,
        )
        for c in ("pip install numpy", "make -j2")
    )  # fmt: skip
    slow_turns.observe_cpu(install.key, 0.2, 4.0)
    slow_turns.observe_cpu(build.key, 4.0, 4.0)
    assert slow_turns.select([install], running=0, forks=0) == [install]
    assert slow_turns.select([build], running=0, forks=0) == []
    # it is the CPU a miss burns that stops the long shot: without the floor (or without weighing CPU) it launched
    for unweighed in (
        CostAwarePolicy(contention=lambda: 0.0, min_contention=0.0, llm_seconds=0.65, memory_weight=0.0),
        CostAwarePolicy(contention=None, llm_seconds=0.65, memory_weight=0.0),
    ):
        unweighed.observe_tool(long_shot.key, 0.03)
        unweighed.observe_cpu(long_shot.key, 0.03, 0.06)
        assert unweighed.select([long_shot], running=0, forks=0) == [long_shot]
    # a busier machine charges more than the floor: the likely guess of a longer computing call still pays at 0.9,
    # a coin flip does not
    busy = CostAwarePolicy(contention=lambda: 1.0, llm_seconds=3.0, memory_weight=0.0)
    coin, sure = read("python3 run.py", 0.5), read("python3 check.py", 0.9)
    for launch in (coin, sure):
        busy.observe_tool(launch.key, 1.0)
        busy.observe_cpu(launch.key, 1.0, 1.0)
    assert busy.select([coin], running=0, forks=0) == []
    assert busy.select([sure], running=0, forks=0) == [sure]


def test_a_fork_is_charged_what_its_making_holds() -> None:
    """Making a fork holds CRIU's processes (the dump's, then the restore's, 1.7-2.7 MiB each on the long-tool
    groups) and the dump's images, beside the rollout: by the fork's cgroup peak when its call is about to start
    (``observe_transient``), for the fork's seconds, hit or miss."""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.5)
    policy.observe_rollout_memory(16 * mib)
    _call_measured(policy)
    policy.observe_fork(0.5, 4 * mib)
    sure = _launch("r", 0, p=1.0, seconds=3.0)
    before = policy.memory_net(sure)
    assert policy.memory_terms(sure).transient == 0  # nothing measured: nothing charged
    policy.observe_transient(3 * mib)
    assert policy.memory_terms(sure).transient == pytest.approx(3 * mib * 0.5)
    assert policy.memory_net(sure) == pytest.approx(before - 3 * mib * 0.5)
    assert CostAwarePolicy(contention=None, memory_weight=0.0).memory_net(sure) > 0  # memory not weighed


def test_a_hits_call_is_charged_what_it_holds_in_a_fork_beyond_the_main_line() -> None:
    """A hit's call was taken to hold on the main line what it holds in the fork, only earlier. By the kernel's
    counters it held more (session 19: ``pip install``, 40 MiB, ran 2.5-3.2 s in forks launched together where it
    ran 0.3-0.7 s on the main line, and calls the cache would have served ran at all). So a call is charged its
    measured bytes (``observe_fork_call``: how far it raised its fork's cgroup) for the seconds it runs in
    forks beyond those on the main line (``observe_tool``); a call never run on the main line for its whole run;
    one never run in a fork, nothing beyond the main line's. (No allowance: each fork must pay for itself.)"""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.0)
    policy.observe_rollout_memory(16 * mib)
    policy.observe_fork(0.2, 1 * mib)
    pip = CallKey.of(BASH, {"command": "pip install flask"})
    sure = _launch("r", 0, p=1.0, seconds=2.0)  # a make: its own signature
    assert policy.select([sure], running=0, forks=0) == [sure]  # no fork's call measured: one at a time
    assert policy.select([_launch("q", 0, p=1.0)], running=0, forks=0) == []
    base = (2.0 * 16 * 2 - 3.2 * 1) * mib  # "r" and "q" level: each its group's straggler (frees twice its bytes)
    assert policy.verdicts["measuring"] == 1
    policy.release(sure, True)
    policy.observe_fork_call(pip, 3.0, 40 * mib)  # a pip in a fork: 40 MiB for 3 s
    assert policy.memory_terms(sure).call == pytest.approx(40 * mib * 2.0)  # any signature's bytes, its whole run
    assert policy.select([sure], running=0, forks=0) == []  # measured: it cannot pay
    make = CallKey.of(BASH, {"command": "make -C r"})
    policy.observe_fork_call(make, 2.0, 2 * mib)  # its own: 2 MiB, 2 s in a fork, never on the main line
    assert policy.memory_net(sure) == pytest.approx(base - 2 * mib * 2.0)
    policy.observe_tool(make, 2.0)  # as long on the main line: nothing beyond
    assert policy.memory_terms(sure).call == 0 and policy.memory_net(sure) == pytest.approx(base)
    assert policy.select([sure], running=0, forks=0) == [sure]
    policy.observe_fork_call(make, 12.0, 2 * mib)  # a fork's run 5 s longer (2 + 0.3 x 10): its bytes that long
    assert policy.memory_terms(sure).call == pytest.approx(2 * mib * 3.0)
    half = _launch("r", 0, p=0.5, seconds=2.0)  # a hit's: times its odds
    assert policy.memory_terms(half).call == pytest.approx(0.5 * 2 * mib * 3.0)
    policy.observe_fork_call(make, -1.0, 2 * mib)  # cut short (a miss cancelled at the ask): its bytes only
    assert policy.calls.fork[key_signature(make)].value == pytest.approx(5.0)
    never = CostAwarePolicy(contention=None)
    never.observe_tool(pip, 0.5)  # never run in a fork: held as on the main line
    assert never.calls.extra(pip, 0.5) == 0


def test_a_miss_is_charged_what_calls_of_its_own_signature_held() -> None:
    """A miss's call holds its memory until the ask: what calls of its signature raised their forks by
    (``observe_fork_call``), not what the last discarded fork's call held whatever it ran (session 19: one missed
    ``pip install``'s 32 MiB was charged to every later guess, a ``python3 script.py`` as much as an install)."""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.0)
    policy.observe_rollout_memory(16 * mib)
    policy.observe_fork(0.2, 4 * mib)
    pip = CallKey.of(BASH, {"command": "pip install torch"})
    policy.observe_fork_call(pip, -1.0, 40 * mib)  # a missed install, cut at the ask
    policy.observe_miss(44 * mib)
    make = _launch("r", 0, p=0.5, seconds=2.0)
    assert policy.memory_terms(make).miss == pytest.approx(0.5 * 40 * mib * 2.0)  # its own not measured: a miss's
    policy.observe_fork_call(make.key, 2.0, 2 * mib)
    assert policy.memory_terms(make).miss == pytest.approx(0.5 * 2 * mib * 2.0)  # its own signature's


def test_forks_that_cannot_pay_alone_launch_within_a_share_of_what_the_rollouts_hold() -> None:
    """Weighed one by one, a fork whose call holds memory cannot pay on small workspaces (a hit frees a fraction
    of a MiB·s per second hidden), and the rule refused nearly everything (session 19). The allowance lets the run
    spend ``memory_share`` of its rollouts' byte-seconds on such forks: each charged its worse outcome while in
    flight, its outcome's cost once released (a hit that saved more than it held gives back)."""
    mib, now = 1 << 20, [0.0]
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.1,
                             clock=lambda: now[0])  # fmt: skip
    policy.observe_rollout_memory(1 * mib)
    policy.observe_fork(0.2, 1 * mib)
    policy.observe_fork_call(CallKey.of(BASH, {"command": "python3 x.py"}), 2.0, 10 * mib)
    guess = _launch("r", 0, p=0.5, seconds=2.0)
    policy.observe_fork_call(guess.key, 2.0, 10 * mib)  # its call: 10 MiB, as long in a fork as on the main line
    policy.observe_tool(guess.key, 2.0)
    assert policy.memory_net(guess) < 0
    hit, miss = policy.outcome_costs(guess)
    assert miss == pytest.approx((3.2 * 1 + 10 * 2.0) * mib)  # the fork held 3.2 s, its call until the ask
    assert hit == pytest.approx((3.2 * 1 - 2.0 * 1) * mib)  # held less freed (the rollout's bytes 2 s sooner)
    assert policy.select([guess], running=0, forks=0) == []  # nothing earned yet
    assert policy.verdicts["memory"] == 1
    now[0] = 100.0  # the rollout ran 100 s at 1 MiB: 100 MiB·s, a tenth of it spendable
    assert policy.select([guess], running=0, forks=0) == []  # 10 MiB·s: its miss would cost 23.2
    assert policy.allowance.balance == pytest.approx(0.1 * 100 * mib)
    now[0] = 250.0
    assert policy.select([guess], running=0, forks=0) == [guess]  # 25 MiB·s
    assert policy.allowance.balance == pytest.approx((25.0 - 23.2) * mib)  # its worse outcome held
    assert policy.select([guess], running=0, forks=1) == []  # the next does not fit beside it
    policy.release(guess, False)
    assert policy.allowance.balance == pytest.approx((25.0 - 23.2) * mib)  # it missed: spent
    now[0] = 400.0
    assert policy.select([guess], running=0, forks=0) == []  # 40 - 23.2 = 16.8 left
    now[0] = 470.0
    assert policy.select([guess], running=0, forks=0) == [guess]  # 47 - 23.2 = 23.8 left: fits
    policy.release(guess, True)  # used: it hid 2 s, and cost 1.2 MiB·s
    assert policy.allowance.balance == pytest.approx((47.0 - 23.2 - 1.2) * mib)
    now[0] = 480.0
    assert policy.select([guess], running=0, forks=0) == [guess]  # 48 - 24.4: its branch never starts (cancelled)
    policy.rollout_done("r")  # ...and is never released: the rollout's end drops its charge
    assert policy.allowance.balance == pytest.approx((48.0 - 23.2 - 1.2) * mib)
    never = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.0)
    never.allowance.earned = 1e12  # however much the rollouts held: each fork must pay alone
    assert not never.allowance.fits(0.0, 1.0)


def test_before_anything_is_measured_only_a_call_that_ends_before_the_ask_is_forked_and_none_is_kept() -> None:
    """The fork launched to measure is weighed by nothing: its cost is bounded only by when it ends. So it must be
    expected to end before the ask (a miss is cancelled then), and no unmeasured fork is kept into the next turn
    (session 20: the first fork of a run, a missed ``pip install torch`` kept across turns, held ~100 MiB for
    20 s, 0.7x fork+cache's whole GiB·s)."""
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2)
    install, short = _launch("a", 0, p=0.9, seconds=15.0), _launch("b", 0, p=0.6, seconds=1.0)
    assert policy.select([install], running=0, forks=0) == []
    assert policy.verdicts["measuring"] == 1
    assert policy.select([install, short], running=0, forks=0) == [short]
    assert policy.allowance.balance == 0  # weighed by priors (a fork as big as its rollout): not charged
    assert not policy.keeps(short)  # unmeasured: let go at the turn's end
    assert policy.verdicts["release"] == 1
    assert CostAwarePolicy(contention=None, memory_weight=0.0).keeps(short)  # memory not weighed: kept


def test_a_calls_memory_is_charged_by_what_it_held_over_time_not_at_its_peak() -> None:
    """A call's bytes are its peak (``call_peak``); held for every second of its run they overcharged a padded call
    (``bench.experiment --pad-tools`` sleeps after a ``pip install`` until its recorded 15 s: its 40 MiB are held for
    a second or two; session 20 refused the siblings' ``pip3 install torch`` hits at -559 MiB·s). The runtime now
    measures the byte-seconds a fork's call held (``CallMeter``): a call is charged those, at most its peak for the
    seconds that count, and a call never run on the main line is still charged its whole measured run (what kept
    the oracle's burst of installs from 1.22x fork+cache's GiB·s)."""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.0)
    policy.observe_rollout_memory(1 * mib)
    policy.observe_fork(0.2, 1 * mib)
    pip = _launch("r", 0, p=0.9, seconds=15.0)
    policy.observe_fork_call(pip.key, 15.0, 40 * mib, 60.0 * mib)  # 40 MiB at its peak, 60 MiB·s over 15 s
    terms = policy.memory_terms(pip)
    assert terms.call == pytest.approx(0.9 * 60.0 * mib)  # never on the main line: its whole run, as measured
    hidden = 3.0  # the LLM time left: what a miss runs before the ask
    assert terms.miss == pytest.approx(0.1 * 60.0 * mib)  # 40 MiB for 3 s at its peak, but a whole run held 60
    assert 40 * hidden > 60
    policy.observe_fork_call(pip.key, 15.0, 40 * mib, 20.0 * mib)  # a quieter run: 20 MiB·s
    held = policy.calls.held[key_signature(pip.key)].value / mib
    assert held == pytest.approx(0.7 * 60 + 0.3 * 20)
    assert policy.memory_terms(pip).call == pytest.approx(0.9 * held * mib)
    assert policy.memory_terms(pip).miss == pytest.approx(0.1 * held * mib)  # less than its peak for 3 s
    policy.observe_fork_call(pip.key, -1.0, 40 * mib, 5.0 * mib)  # cut short at 5 MiB·s: a whole run held more
    assert policy.calls.held[key_signature(pip.key)].value == held * mib
    policy.observe_fork_call(pip.key, -1.0, 40 * mib, 90.0 * mib)  # cut short, and already more: it counts
    assert policy.calls.held[key_signature(pip.key)].value == pytest.approx((0.7 * held + 0.3 * 90) * mib)
    # on the main line too, 15 s as in forks (a padded call): nothing beyond; 20 s in forks: its mean bytes 5 s
    policy.observe_tool(pip.key, 15.0)
    assert policy.memory_terms(pip).call == 0
    policy.observe_fork_call(pip.key, 31.67, 40 * mib, 40.0 * mib)
    fork = policy.calls.fork[key_signature(pip.key)].value
    held = policy.calls.held[key_signature(pip.key)].value
    beyond = fork - policy.calls.main[key_signature(pip.key)].value
    assert policy.memory_terms(pip).call == pytest.approx(0.9 * held / fork * beyond)
    assert held / fork < 40 * mib  # below its peak


@pytest.mark.parametrize(("seconds", "byte_seconds"), [(15.0, -1.0), (-1.0, 2.0 * (1 << 20))])
def test_a_call_without_a_whole_run_measured_is_charged_its_peak_for_its_seconds(
    seconds: float, byte_seconds: float
) -> None:
    """Without a memory controller the runtime reports no byte-seconds (-1), and a run cut short at the ask says
    what the call held until then, not what a whole run holds (online, a ``pip install`` cut after a second had
    held 2 MiB·s of its ~30): until a whole run is measured the rule charges the peak for the seconds that count,
    as before."""
    mib = 1 << 20
    policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.0)
    policy.observe_rollout_memory(1 * mib)
    policy.observe_fork(0.2, 1 * mib)
    pip = _launch("r", 0, p=0.9, seconds=15.0)
    policy.observe_fork_call(pip.key, seconds, 40 * mib, byte_seconds)
    assert policy.memory_terms(pip).call == pytest.approx(0.9 * 40 * mib * 15.0)
    assert policy.memory_terms(pip).miss == pytest.approx(0.1 * 40 * mib * 3.0)


def test_a_padded_install_that_held_its_peak_briefly_launches_within_the_allowance() -> None:
    """The decision the change is for: a likely install hit whose peak held for all its seconds does not fit the
    allowance, and fits it once charged what it was measured to hold."""
    mib, now = 1 << 20, [0.0]

    def policy_with(byte_seconds: float) -> CostAwarePolicy:
        policy = CostAwarePolicy(contention=None, llm_seconds=3.0, fork_seconds=0.2, memory_share=0.1,
                                 clock=lambda: now[0])  # fmt: skip
        policy.observe_rollout_memory(1 * mib)
        policy.observe_fork(0.2, 1 * mib)
        policy.observe_fork_call(_launch("q", 0).key, 15.0, 40 * mib, byte_seconds)
        return policy

    peak, measured = policy_with(-1.0), policy_with(40.0 * mib)
    pip = _launch("r", 0, p=0.9, seconds=15.0)
    assert peak.select([pip], running=0, forks=0) == measured.select([pip], running=0, forks=0) == []  # 0 earned
    now[0] = 500.0  # one rollout, 500 s at 1 MiB: 50 MiB·s to spend
    assert max(measured.outcome_costs(pip)) == pytest.approx((3.2 * 1 + 40) * mib)  # a miss: its fork, its call
    assert max(peak.outcome_costs(pip)) == pytest.approx((3.2 * 1 + 40 * 15 - 3) * mib)  # a hit: its peak 15 s
    assert peak.select([pip], running=0, forks=0) == [] and peak.verdicts["memory"] == 2
    assert measured.select([pip], running=0, forks=0) == [pip]
