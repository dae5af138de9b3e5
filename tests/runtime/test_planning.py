"""Launch planning over plain data (no root, no workspace): which predicted calls may start, deduplicated and
ranked, without what is in flight or vetoed; chains one call deeper; the policy's budgets over the options; the
scoring of predictors' guesses; which unused branches a turn hands to the next."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bunshin_async._runtime._calls import CallKey, Candidate, PredictionContext, chain_root, extend_chain
from bunshin_async._runtime._planning import (
    Classified,
    KeepOption,
    choose_kept,
    context_after,
    plan_launches,
    proposals,
    scores,
)
from bunshin_async._runtime._speculation import BoundedPolicy, LiveForks
from bunshin_async._runtime._telling import Ran, positional, tell_run
from bunshin_async._tools._tools import Effect, bash_tool

pytestmark = pytest.mark.unit

BASH = bash_tool()


def _key(command: str) -> CallKey:
    return CallKey.of(BASH, {"command": command})


def _p(command: str, p: float, *, effect: Effect = Effect.READ, source: str = "s", det: bool = True) -> Classified:
    cand = Candidate(name="bash", arguments={"command": command}, probability=p, source=source)
    return Classified(cand, _key(command), effect, det)


def test_one_launch_per_call_the_most_probable_best_first() -> None:
    plans = plan_launches([_p("ls", 0.2, source="a"), _p("make", 0.5, effect=Effect.WRITE), _p("ls", 0.4, source="b")])
    assert [(o.key, o.probability, o.candidate.source) for o in plans] == [
        (_key("make"), 0.5, "s"),
        (_key("ls"), 0.4, "b"),
    ]
    assert [o.needs_fork for o in plans] == [True, False]
    # each launch says whose it is: the rollout, its progress and its group (a shared policy's straggler is per group)
    mine = plan_launches([_p("ls", 0.4)], rollout="r1", progress=3, group="task-7")
    assert [(o.rollout, o.progress, o.group) for o in mine] == [("r1", 3, "task-7")]


def test_external_nondeterministic_and_unknown_calls_are_never_planned() -> None:
    unknown = Classified(Candidate(name="nope", arguments={}, probability=0.9), None, Effect.EXTERNAL, False)
    predictions = [_p("curl x", 0.9, effect=Effect.EXTERNAL), _p("date", 0.9, det=False), unknown, _p("ls", 0.1)]
    assert [o.key for o in plan_launches(predictions)] == [_key("ls")]
    assert proposals(predictions) == {"s": {_key("ls"): 0.1}}


def test_what_is_in_flight_or_vetoed_is_left_out() -> None:
    predictions = [_p("ls", 0.9), _p("cat a", 0.8), _p("make", 0.7, effect=Effect.WRITE)]
    plans = plan_launches(predictions, in_flight={_key("ls")}, veto=lambda o: o.key == _key("cat a"))
    assert [o.key for o in plans] == [_key("make")]
    assert plan_launches(predictions, in_flight={_key(c) for c in ("ls", "cat a", "make")}) == []


def test_a_chained_launch_is_one_deeper_and_pays_with_its_parents_odds() -> None:
    (parent,) = plan_launches([_p("make", 0.5, effect=Effect.WRITE)], turn_elapsed=1.5, rollout="r", progress=3)
    assert (parent.depth, parent.prior, parent.turn_elapsed, parent.rollout, parent.progress) == (0, 1.0, 1.5, "r", 3)
    (child,) = plan_launches([_p("make test", 0.6, effect=Effect.WRITE)], parent=parent)
    assert (child.depth, child.prior, child.parent) == (1, 0.5, parent)
    assert child.probability == pytest.approx(0.3)


def test_the_bounded_policy_keeps_to_its_budgets() -> None:
    options = plan_launches(
        [_p("make a", 0.9, effect=Effect.WRITE), _p("make b", 0.8, effect=Effect.WRITE), _p("ls", 0.5), _p("cat", 0.1)]
    )
    policy = BoundedPolicy(max_branches=3, max_forks=1, min_probability=0.2)
    assert [o.key for o in policy.select(options, running=0, forks=0)] == [_key("make a"), _key("ls")]
    assert [o.key for o in policy.select(options, running=0, forks=1)] == [_key("ls")]  # the fork budget is spent
    assert policy.select(options, running=3, forks=0) == []  # so is the branch budget


def test_the_bounded_policy_counts_a_fork_until_it_is_released_not_while_its_turn_lives() -> None:
    """Inside ``handle.background()`` a finished turn's unused forks close in the handle's task group while the next
    turn selects with ``forks=0`` (its own live branches): the policy counts them until the runtime's ``release``
    (its fork closed), per rollout, and forgets a rollout that ended."""
    policy = BoundedPolicy(max_branches=4, max_forks=1)
    (make_a,) = plan_launches([_p("make a", 0.9, effect=Effect.WRITE)], rollout="r")
    (make_b,) = plan_launches([_p("make b", 0.9, effect=Effect.WRITE)], rollout="r")
    (ls,) = plan_launches([_p("ls", 0.9)], rollout="r")
    (other,) = plan_launches([_p("make b", 0.9, effect=Effect.WRITE)], rollout="s")
    assert policy.select([make_a], running=0, forks=0) == [make_a]
    assert policy.select([make_b, ls], running=0, forks=0) == [ls]  # make a's fork still closes: the budget is spent
    assert policy.select([other], running=0, forks=0) == [other]  # another rollout's budget is its own
    policy.release(ls, used=False)  # an in-place read held no fork
    assert policy.select([make_b], running=0, forks=0) == []
    policy.release(make_a, used=False)  # its fork closed
    assert policy.select([make_b], running=0, forks=0) == [make_b]
    assert policy.live.of("r") == 1 and policy.live.total() == 2
    policy.rollout_done("r")
    assert policy.select([make_a], running=0, forks=0) == [make_a]


def test_both_policies_count_forks_in_flight_with_one_ledger() -> None:
    """``speculator``'s policy bounds a group's forks in flight with the same ``LiveForks`` (not a copy of it)."""
    from speculator import CostAwarePolicy

    assert type(CostAwarePolicy().live) is type(BoundedPolicy().live) is LiveForks


def test_each_predictors_guesses_are_scored_against_the_call_or_what_it_filters() -> None:
    proposed = proposals([_p("ls", 0.7, source="a"), _p("cat", 0.6, source="a"), _p("make", 0.2, source="b")])
    assert scores(proposed, {_key("cat"), None}) == [("a", 1.0, True), ("b", 0.2, False)]


def test_the_context_after_a_call_extends_history_and_chain() -> None:
    ctx = PredictionContext(history=(_key("a"),), chain=chain_root("t"), turn=2, position=0, group="g")
    after = context_after(ctx, _key("b"), "out")
    assert after.history == (_key("a"), _key("b")) and after.decided == (_key("b"),)
    assert after.chain == extend_chain(chain_root("t"), _key("b"))
    assert (after.position, after.turn, after.group, after.last_output) == (1, 2, "g", "out")


def test_kept_branches_finished_first_then_likeliest_with_their_ancestors() -> None:
    alive = [
        KeepOption(done=False, probability=0.9, chain=(1,)),
        KeepOption(done=True, probability=0.3, chain=(2,)),
        KeepOption(done=True, probability=0.6, chain=(3, 4)),  # chained after 4: both or neither
    ]
    assert choose_kept(alive, 3) == [4, 3, 2]
    assert choose_kept(alive, 2) == [4, 3]
    assert choose_kept(alive, 1) == [2]  # 3 needs its parent too: no room
    assert choose_kept(alive, 0) == []


def test_a_policys_fork_call_hook_of_the_first_form_is_told_that_form() -> None:
    """``observe_fork_call`` gained ``byte_seconds`` (session 21): a policy written for (key, seconds, bytes) is told
    those three, a newer one all four, one taking ``*args`` all four."""
    told: list[tuple[object, ...]] = []

    class Old:
        def observe_fork_call(self, key: CallKey, seconds: float, held: int) -> None:
            told.append((key, seconds, held))

    class New:
        def observe_fork_call(self, key: CallKey, seconds: float, held: int, byte_seconds: float = -1.0) -> None:
            told.append((key, seconds, held, byte_seconds))

    def anything(*args: object) -> None:
        told.append(args)

    # a fork's call that ran 2 s, raised its cgroup by nothing and held 5 byte-seconds
    for hook in (Old().observe_fork_call, New().observe_fork_call, anything):
        policy = SimpleNamespace(observe_fork_call=hook)
        tell_run(policy, _key("make"), 2.0, Ran.FORK, memory=lambda: (0, 5.0))
    assert told == [(_key("make"), 2.0, 0), (_key("make"), 2.0, 0, 5.0), (_key("make"), 2.0, 0, 5.0)]
    assert positional(len, 4) == 1


def test_a_policy_is_told_a_run_by_where_it_ran() -> None:
    """``tell_run``, which the main line, the branches and the offline replay all call: a main-line run (or a call
    a tool cache served there) its seconds and CPU; a read in place its seconds; a fork's call, hit or miss, only
    ``observe_fork_call`` (its memory measured then alone), or, for a policy without that hook, its seconds as any
    run's; a run cut short (negative seconds) nothing but the fork's hook."""
    told: list[tuple[object, ...]] = []
    measured: list[str] = []

    class Full:
        def observe_tool(self, key: CallKey, seconds: float) -> None:
            told.append(("tool", seconds))

        def observe_cpu(self, key: CallKey, cpu_seconds: float, seconds: float) -> None:
            told.append(("cpu", cpu_seconds, seconds))

        def observe_fork_call(self, key: CallKey, seconds: float, held: int, byte_seconds: float) -> None:
            told.append(("fork", seconds, held, byte_seconds))

    def memory() -> tuple[int, float]:
        measured.append("memory")
        return 7, 9.0

    key, full, bounded = _key("make"), Full(), BoundedPolicy()
    tell_run(full, key, 2.0, Ran.MAIN, cpu_seconds=0.5, memory=memory)  # type: ignore[arg-type]
    tell_run(full, key, 2.0, Ran.MAIN)  # type: ignore[arg-type]  # CPU not read
    tell_run(full, key, 2.0, Ran.IN_PLACE, cpu_seconds=0.5)  # type: ignore[arg-type]
    tell_run(full, key, 2.0, Ran.FORK, cpu_seconds=0.5, memory=memory)  # type: ignore[arg-type]
    tell_run(full, key, -1.0, Ran.FORK, memory=memory)  # type: ignore[arg-type]  # cut short: what it held so far
    tell_run(full, key, -1.0, Ran.IN_PLACE)  # type: ignore[arg-type]
    assert told == [("tool", 2.0), ("cpu", 0.5, 2.0), ("tool", 2.0), ("tool", 2.0), ("fork", 2.0, 7, 9.0),
                    ("fork", -1.0, 7, 9.0)]  # fmt: skip
    assert measured == ["memory", "memory"]
    seen: list[float] = []
    bounded.observe_tool = lambda key, seconds: seen.append(seconds)  # type: ignore[method-assign]
    tell_run(bounded, key, 3.0, Ran.FORK)  # no fork hook: told as a run
    tell_run(bounded, key, -1.0, Ran.FORK)
    assert seen == [3.0]
