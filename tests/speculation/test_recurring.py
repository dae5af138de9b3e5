"""Predictors of calls that recur across rollouts and tasks, their calibration, and the offline evaluation on small
synthetic groups (no workspaces, no root)."""

from __future__ import annotations

from typing import Any

import pytest

from bunshin_async.speculation import PredictionContext
from speculator import NgramModel, SiblingPredictor, SiblingTable, SignaturePredictor, default_speculation
from speculator._offline import calibration, evaluate, leave_task_out

from .test_predictors import chain, ctx, key

pytestmark = pytest.mark.unit


def _model() -> NgramModel:
    """After a failed script run, an install; after an install, the script again (as many traces do)."""
    model = NgramModel()
    for n in range(30):
        model.add_sequence([
            ("bash", {"command": f"python run{n}.py"}),
            ("bash", {"command": f"pip install pkg{n}"}),
            ("bash", {"command": f"python run{n}.py"}),
        ])  # fmt: skip
    return model


def test_signatures_fill_a_predicted_signature_with_a_siblings_call() -> None:
    """The model says an install follows a script run; this rollout never installed anything, but a sibling
    installed ``numpy`` after the same kind of run: that install is the guess."""
    table = SiblingTable()
    sibling = SignaturePredictor(_model(), table)
    sibling.observe(ctx("ls", "python app.py"), key("pip install numpy"))
    [guess] = SignaturePredictor(_model(), table).predict(ctx("ls", "python main.py"))
    assert guess.arguments["command"] == "pip install numpy" and guess.source == "signatures"
    assert 0.5 < guess.probability <= 1.0
    # after the install, the rollout's own script run (an exact repeat), not a sibling's
    [again, *_] = SignaturePredictor(_model(), table).predict(ctx("python main.py", "pip install numpy"))
    assert again.arguments["command"] == "python main.py"
    # nothing to fill a signature with: no guess
    assert SignaturePredictor(_model(), SiblingTable()).predict(ctx("ls", "python main.py")) == []


def test_calibration_maps_stated_odds_to_what_they_scored() -> None:
    model = _model()
    table = SiblingTable()
    SignaturePredictor(model, table).observe(ctx("python app.py"), key("pip install numpy"))
    stated = SignaturePredictor(model, table).predict(ctx("python main.py"))[0].probability
    model.calibration = {"signatures": [0.01 * (b + 1) for b in range(10)]}
    [guess] = SignaturePredictor(model, table).predict(ctx("python main.py"))
    assert guess.probability == pytest.approx(0.01 * (min(9, int(stated * 10)) + 1))
    again = NgramModel.from_table(model.to_table(min_count=1))
    assert again.calibration == model.calibration and again.calibrated("other", 0.42) == 0.42


def test_calibration_is_shrunk_and_never_decreasing() -> None:
    from speculator._offline import OfflineReport

    report = OfflineReport(calibration={"x": [(0.1, 100, 50), (0.5, 100, 10), (0.9, 1000, 900)], "all": []})
    rates = calibration(report)["x"]
    assert list(rates) == sorted(rates) and len(rates) == 10
    assert rates[9] == pytest.approx((900 + 2 * 0.95) / 1002, abs=1e-3)  # many guesses: what they scored
    assert 0.1 < rates[1] == rates[5] < 0.5  # a violation pooled: 0.1's 50% and 0.5's 10% become one rate
    assert "all" not in calibration(report)


def _record(task: str, *steps: tuple[str, float, float]) -> dict[str, Any]:
    return {"task_id": task, "steps": [{"tool": "bash", "args": {"command": c}, "llm_seconds": llm,
                                        "tool_seconds": tool, "kind": "exec"} for c, llm, tool in steps]}  # fmt: skip


def test_offline_replay_starts_a_group_together_and_credits_only_siblings_ahead() -> None:
    """Two rollouts start together; rollout 0 reads ``a`` then installs (decided at t=3 s); rollout 1 (a slower
    model) reads ``b`` first, then ``a``, and starts its install's turn at t=21 s: the sibling ahead made the install
    after the same previous call, so it is predicted (hidden: min(tool 10, LLM 5)). The shared first call is served
    by the prefix cache (not hideable); rollout 0's own install had no sibling ahead of it."""
    groups = {
        "t": [
            _record("t", ("ls", 1.0, 0.0), ("cat a", 1.0, 0.0), ("pip install numpy", 1.0, 10.0)),
            _record("t", ("ls", 1.0, 0.0), ("cat b", 19.0, 0.0), ("cat a", 1.0, 0.0), ("pip install numpy", 5.0, 10.0)),
        ]
    }
    table = SiblingTable()
    report = evaluate(groups, lambda task: lambda: [SiblingPredictor(table, after_confidence=0.6)])
    assert report.calls == 7 and report.cache_hits == 1
    assert report.hideable_seconds == pytest.approx(1.0 + 5.0)
    assert report.by_source["siblings"]["hidden_seconds"] == pytest.approx(5.0)
    assert report.share("siblings") == pytest.approx(5.0 / 6.0)
    # launched d s after the observation instead of on it, a branch hides min(tool, LLM - d) of a call
    late = evaluate(groups, lambda task: lambda: [], delays=(0.0, 0.5, 2.0))
    assert late.hideable_after == [(0.0, 6.0), (0.5, 0.5 + 4.5), (2.0, 0.0 + 3.0)]
    assert dict(leave_task_out({**groups, "u": [_record("u", ("ls", 1, 0))]}))["t"] == [_record("u", ("ls", 1, 0))]


def test_offline_reask_credits_a_siblings_call_made_during_the_turn_with_what_is_left_of_it() -> None:
    """Rollout 1's install turn starts at t=2 s and lasts 8 s; rollout 0 installs after the same previous call at
    t=6 s. Asked only at the turn's start, nothing is guessed; asked again when the sibling decides, the install is
    guessed with 4 s of the turn left: it hides min(tool 10, 8 - 4)."""
    groups = {
        "t": [
            _record("t", ("ls", 1.0, 0.0), ("cat a", 1.0, 0.0), ("pip install numpy", 4.0, 10.0)),
            _record("t", ("ls", 1.0, 0.0), ("cat b", 0.5, 0.0), ("cat a", 0.5, 0.0), ("pip install numpy", 8.0, 10.0)),
        ]
    }

    def make(task: str) -> Any:
        table = SiblingTable()
        return lambda: [SiblingPredictor(table, after_confidence=0.6)]

    once = evaluate(groups, make)
    assert once.by_source.get("siblings", {}).get("hidden_seconds", 0.0) == 0.0
    again = evaluate(groups, make, reask=True)
    assert again.by_source["siblings"]["hidden_seconds"] == pytest.approx(4.0)
    assert again.by_source["siblings"]["committed"] == 1 and again.hideable_seconds == once.hideable_seconds


def test_default_speculation_leaves_out_what_the_ablation_names() -> None:
    names = [p.name for p in default_speculation(model=_model()).predictors]
    assert names == ["siblings", "observation", "docs", "recent", "written", "steps", "history", "signatures"]
    without = default_speculation(model=_model(), without=["siblings", "signatures"]).predictors
    assert [p.name for p in without] == ["observation", "docs", "recent", "written", "steps", "history"]


def test_signatures_see_the_calls_decided_earlier_in_the_message() -> None:
    table = SiblingTable()
    SignaturePredictor(_model(), table).observe(ctx("python app.py"), key("pip install numpy"))
    history = (key("ls"),)
    at_second = PredictionContext(
        history=history, chain=chain(list(history)), turn=1, position=1, decided=(key("python main.py"),)
    )
    [guess] = SignaturePredictor(_model(), table).predict(at_second)
    assert guess.arguments["command"] == "pip install numpy"  # the decided script run counts as history


def test_siblings_answer_an_observation_that_ended_the_same_way_alike() -> None:
    """After the same test run, a sibling whose run failed on a missing module installed; another whose run passed
    built. A rollout whose run fails on *another* module is predicted the install (the same ending, another name),
    ranked above what the sibling with a passing run did."""
    table = SiblingTable()
    fail = "Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'numpy'\n"
    ok = "....\nRan 4 tests in 0.01s\nOK\n"
    SiblingPredictor(table).observe(seen_ctx(fail, "ls", "pytest"), key("pip install -r requirements.txt"))
    SiblingPredictor(table).observe(seen_ctx(ok, "cat x", "pytest"), key("make build"))
    other = "Traceback (most recent call last):\n  x\nModuleNotFoundError: No module named 'scipy'\n"
    [top] = SiblingPredictor(table).predict(seen_ctx(other, "cat y", "pytest"))
    assert top.arguments["command"] == "pip install -r requirements.txt"
    assert top.probability == pytest.approx(SiblingPredictor(table).similar_confidence)
    # an ending no sibling saw: whatever followed the same call
    assert len(SiblingPredictor(table).predict(seen_ctx("Segmentation fault\n", "cat y", "pytest"))) == 2


def seen_ctx(output: str, *cmds: str) -> PredictionContext:
    history = tuple(key(c) for c in cmds)
    return PredictionContext(history=history, chain=chain(list(history)), turn=len(cmds), position=0,
                             last_output=output)  # fmt: skip
