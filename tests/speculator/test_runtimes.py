"""Run times by call signature, learned from timed traces, stated on guesses that state none."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from bunshin_async.speculation import CallKey, Candidate, PredictionContext
from speculator import RunTimes, SiblingTable, TimedPredictor, default_speculation

pytestmark = pytest.mark.unit


def _step(command: str, seconds: float | None) -> dict[str, object]:
    return {"tool": "bash", "args": {"command": command}, "kind": "exec", "tool_seconds": seconds}


def test_a_signature_is_expected_to_take_its_calls_mean_once_seen_often_enough() -> None:
    times = RunTimes(min_count=3)
    times.add_record({"steps": [_step("pip install numpy", 10.0), _step("pip install torch", 40.0)]})
    assert times.seconds("bash", {"command": "pip install flask"}) is None  # two calls say too little
    times.add_record({"steps": [_step("pip install requests", 10.0), _step("ls", None), _step("ls", 0.1)]})
    # another package, the same program: the mean of the three (heavy tails pull it up: a long estimate costs
    # little where the gain is capped at the LLM time left, a short one refuses every long call)
    assert times.seconds("bash", {"command": "pip install flask"}) == pytest.approx(20.0)
    assert times.seconds("bash", {"command": "ls -la"}) is None  # an untimed step is no evidence
    again = RunTimes.from_table(times.to_table())
    assert again.seconds("bash", {"command": "pip install flask"}) == pytest.approx(20.0)
    assert again.seconds("bash", {"command": "ls"}) is None  # not in the table: seen under min_count times


class _Fixed:
    name = "fixed"

    def __init__(self, *candidates: Candidate) -> None:
        self.candidates = candidates
        self.observed: list[CallKey] = []

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        return self.candidates

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.observed.append(call)


def test_a_guess_states_its_signatures_run_time_unless_its_predictor_did() -> None:
    times = RunTimes(min_count=1)
    times.add("bash", {"command": "pip install x"}, 30.0)
    own = Candidate(name="bash", arguments={"command": "pip install y"}, probability=0.5, expected_seconds=2.0)
    bare = Candidate(name="bash", arguments={"command": "pip install z"}, probability=0.5)
    unknown = Candidate(name="bash", arguments={"command": "make"}, probability=0.5)
    inner = _Fixed(own, bare, unknown)
    timed = TimedPredictor(inner, times)
    ctx = PredictionContext(history=(), chain=b"", turn=0, position=0)
    assert [c.expected_seconds for c in timed.predict(ctx)] == [2.0, 30.0, None]
    assert timed.name == "fixed"  # it is that predictor: an ablation leaves it out by its name
    key = CallKey("bash", "1", b"{}")
    timed.observe(ctx, key)
    assert inner.observed == [key]


def test_default_speculation_times_every_predictor_it_keeps() -> None:
    times = RunTimes()
    plain = default_speculation(table=SiblingTable(), without=["siblings"])
    timed = default_speculation(table=SiblingTable(), without=["siblings"], times=times)
    assert [p.name for p in timed.predictors] == [p.name for p in plain.predictors]
    assert all(isinstance(p, TimedPredictor) for p in timed.predictors)
    assert not any(isinstance(p, TimedPredictor) for p in plain.predictors)
