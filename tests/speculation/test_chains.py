"""Chained speculation and branches kept across turns, through ``run_agent`` on real workspaces and CRIU forks: a
write predicted at a turn's start runs in a fork, the call predicted after it runs in a fork of that fork, and a
later turn commits the chain's prefix that matches the model's calls; the rest leaves no trace. Every run is
compared with the plain agent loop (no turn runtime): same calls, same results, same final workspace state."""

from __future__ import annotations

from typing import Any

import pytest

from bunshin_async._tools._tools import builtin_tools
from bunshin_async.speculation import BranchRecord, Launch, Speculation
from speculator import CostAwarePolicy, Rule, RulePredictor

from .agent_loop import Run, held_client, off_and_on, signalling_tools
from .conftest import bash, final, trajectory

TOOLS = builtin_tools()
A = "sleep 0.3; echo a > d/f; echo a-done"
B = "sleep 0.3; echo b >> d/f; cat d/f"
OTHER_WRITE = "echo c > d/g"
OTHER_READ = "cat d/f"
CHECK = "ls d; cat d/f; ps -eo args= | grep -c '[s]leep 0.3' || true"


def _rules(*extra: Rule) -> list[Rule]:
    return [
        Rule(after="^mkdir -p d$", then_tool="bash", then_args={"command": A}, expected_seconds=1.0),
        Rule(after="echo a > d/f", then_tool="bash", then_args={"command": B}, expected_seconds=1.0),
        *extra,
    ]


def _speculation(rules: list[Rule], *, keep: int = 2) -> Speculation:
    # memory not weighed: these tests are about the mechanism (the 0.6 guesses must launch, whatever forks hold)
    policy = CostAwarePolicy(contention=None, loop_load=None, llm_seconds=1.5, memory_weight=0.0)
    return Speculation(predictors=[RulePredictor(rules)], policy=policy, group="chain", keep=keep)


async def _both(serve: Any, steps: list[Any], spec: Speculation, hold: str | None = None) -> tuple[Run, Run]:
    """Off and on; ``hold``: the run with speculation on holds the model's second answer (A's turn, or the turn
    before it) until a call of ``hold`` has started (``held_client``; only a branch runs it that early): under load a
    fork took longer than the scripted turn, and a branch meant to run (or chain) while the model thought did not."""
    async with serve([trajectory("chain", steps)]) as client:
        if hold is None:
            return await off_and_on(client, "replay:chain", TOOLS, spec)
        tools, started = signalling_tools(TOOLS, hold)
        gated = held_client(client, 2, started)
        try:
            return await off_and_on(client, "replay:chain", TOOLS, spec, on_client=gated, on_tools=tools)
        finally:
            await gated.close()


def _branches(run: Run) -> dict[str, BranchRecord]:
    out = {}
    for turn in run.turns:
        for b in turn.branches:
            out[b.tool + ":" + str(b.depth)] = b
    assert len(out) == sum(len(t.branches) for t in run.turns)
    return out


@pytest.mark.parametrize("layout", ["next_turn", "same_message"])
async def test_a_chain_two_calls_deep_commits_both(serve: Any, layout: str) -> None:
    # The model thinks 1.5 s before asking for A: A runs in a fork, then B in a fork of A's fork; both are done
    # when the model asks for them (in the next turn, or in the same message). A's turn is held until B started:
    # under load a fork took longer than the 1.5 s, A was asked for while it ran and B never chained.
    same = layout == "same_message"
    steps = [
        bash("mkdir -p d", llm=0.05, turn=0),
        bash(A, llm=1.5, turn=1),
        bash(B, llm=0.0 if same else 0.05, turn=1 if same else 2),
        bash(CHECK, llm=0.05, turn=2 if same else 3),
        final(),
    ]
    off, on = await _both(serve, steps, _speculation(_rules()), hold=B)
    assert on.calls[2].outcome.endswith("a\nb\n") and on.calls[3].outcome.endswith("a\nb\n0\n")
    branches = [b for t in on.turns for b in t.branches]
    assert [(b.depth, b.outcome) for b in branches] == [(0, "committed"), (1, "committed")], branches
    child = branches[1]
    assert child.probability == pytest.approx(0.9 * 0.9)  # the chain's probability
    assert child.saved_seconds > 0  # it ran while the model thought (started before it was due)
    assert on.metrics.committed == 2 and on.metrics.wasted == 0 and on.moved


@pytest.mark.parametrize("then", [OTHER_WRITE, OTHER_READ])
async def test_a_chain_whose_second_call_mismatches_commits_only_the_first(serve: Any, then: str) -> None:
    steps = [
        bash("mkdir -p d", llm=0.05, turn=0),
        bash(A, llm=1.5, turn=1),
        bash(then, llm=0.05, turn=2),  # not B: B's fork goes (at once for a write, at the rollout's end for a read)
        bash(CHECK, llm=0.05, turn=3),
        final(),
    ]
    off, on = await _both(serve, steps, _speculation(_rules()), hold=B)  # B chained before A was asked for
    # d holds A's file (and C's), f only A's line, and no sleep of B's is left: no trace of B
    assert on.calls[3].outcome == ("exit code 0\nf\ng\na\n0\n" if then == OTHER_WRITE else "exit code 0\nf\na\n0\n")
    branches = _branches(on)
    assert branches["bash:0"].outcome == "committed" and branches["bash:1"].outcome == "wasted"
    assert on.metrics.committed == 1 and on.metrics.wasted == 1
    assert on.metrics.wasted_cpu_seconds > 0  # a misprediction's cost is counted, also one ended after its turn


def _kept_steps() -> list[Any]:
    """A predicted at turn 1's start, turn 1 asks for a read, turn 2 for A."""
    return [
        bash("mkdir -p d", llm=0.05, turn=0),
        bash("ls d", llm=1.2, turn=1),
        bash(A, llm=0.05, turn=2),
        bash(CHECK, llm=0.05, turn=3),
        final(),
    ]


async def test_a_branch_is_kept_across_turns_while_the_state_is_unchanged(serve: Any) -> None:
    # Predicted at turn 1's start, A is not what turn 1 asks for (a read): it stays alive and turn 2 commits it.
    # A second prediction (A2) is also done by then, but only one branch may be kept: the likelier one.
    a2 = "sleep 0.3; echo x > d/x"
    rules = [
        Rule(after="^mkdir -p d$", then_tool="bash", then_args={"command": A}, expected_seconds=1.0),
        Rule(after="^mkdir -p d$", then_tool="bash", then_args={"command": a2}, probability=0.6, expected_seconds=1),
    ]
    # turn 1's answer is held until A started (under load a fork took longer than the turn)
    off, on = await _both(serve, _kept_steps(), _speculation(rules, keep=1), hold=A)
    kinds = [e.kind for e in on.turns[2].timeline]
    assert "branch_kept" in kinds  # turn 2 took over turn 1's branch
    records = {b.probability: b for t in on.turns for b in t.branches}
    assert records[0.9].outcome == "committed" and records[0.9].saved_seconds > 0
    assert records[0.6].outcome == "wasted"  # beyond the bound: discarded when turn 1 ended
    assert [b.probability for b in on.turns[1].branches] == [0.6]
    assert on.calls[3].outcome == "exit code 0\nf\na\n0\n"  # A's write, none of A2's


async def test_a_kept_branch_goes_as_soon_as_a_write_happens(serve: Any) -> None:
    steps = [
        bash("mkdir -p d", llm=0.05, turn=0),
        bash("echo z > d/z", llm=1.2, turn=1),  # a write: A (started from the state before it) is discarded
        bash(A, llm=0.05, turn=2),  # ... and runs again, on the main line, in the new state
        bash(CHECK, llm=0.05, turn=3),
        final(),
    ]
    off, on = await _both(serve, steps, _speculation(_rules()), hold=B)  # B chained before turn 1's write
    # A and the B chained after it, both discarded by the write (B, predicted again after the main line's A,
    # is launched in turn 3 and discarded when the rollout ends)
    assert sorted((b.depth, b.outcome) for b in on.turns[1].branches) == [(0, "wasted"), (1, "wasted")]
    assert on.calls[2].outcome.endswith("a-done\n")
    assert on.calls[3].outcome == "exit code 0\nf\nz\na\n0\n"


class NoTurnPays(CostAwarePolicy):
    """Launches as the cost-aware policy does (memory not weighed) but says no branch pays for another turn's hold
    (its rule's verdict is unit-tested in test_policy.py): the runtime must then keep none."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.asked: list[Launch] = []

    def keeps(self, launch: Launch) -> bool:
        self.asked.append(launch)
        return False


async def test_a_branch_whose_hold_cannot_pay_is_not_kept(serve: Any) -> None:
    # As in the kept test above, A is predicted at turn 1's start and not asked for in turn 1; the policy says
    # keeping it for turn 2 cannot pay: it is let go when turn 1 ends and turn 2 runs A on the main line.
    rules = [Rule(after="^mkdir -p d$", then_tool="bash", then_args={"command": A}, expected_seconds=1.0)]
    policy = NoTurnPays(contention=None, llm_seconds=1.5, memory_weight=0.0)
    spec = Speculation(predictors=[RulePredictor(rules)], policy=policy, group="chain", keep=2)
    off, on = await _both(serve, _kept_steps(), spec)
    assert [launch.key.name for launch in policy.asked][:1] == ["bash"]  # asked about A when turn 1 ended
    assert on.turns[1].released >= 1 and on.metrics.released >= 1
    assert all(e.kind != "branch_kept" for t in on.turns for e in t.timeline)
    records = [b for t in on.turns for b in t.branches if b.probability == 0.9]
    assert records and records[0].outcome == "wasted"  # let go, not committed
    assert on.calls[2].outcome.endswith("a-done\n") and on.calls[3].outcome == "exit code 0\nf\na\n0\n"
