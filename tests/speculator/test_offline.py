"""What an online run printed, given to the offline replays: matched to a trace's calls, bounded, and seen by the
predictors as the runtime's ``last_output`` of the previous call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bunshin_async.speculation import CallKey, Candidate, PredictionContext, Predictor
from speculator._offline import (
    OBSERVATION_CHARS,
    ObservedCall,
    bounded_output,
    evaluate,
    load_observations,
    with_observations,
)
from speculator._replay import replay

pytestmark = pytest.mark.unit


def _record(*commands: str, extra: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    steps = [{"tool": "bash", "args": {"command": c}, "llm_seconds": 1.0, "tool_seconds": 0.5} for c in commands]
    return {"task_id": "t", "steps": [*steps, *extra]}


def _observed(rollout: int, index: int, command: str, output: str, config: str = "fork+cache") -> ObservedCall:
    return ObservedCall(config=config, repeat=1, task_id="t", rollout=rollout, index=index, tool="bash",
                        args={"command": command}, exit_code=0, output=output)  # fmt: skip


class _Seen:
    """Records the ``last_output`` it is asked with, per turn."""

    name = "seen"

    def __init__(self, out: list[tuple[int, str]]) -> None:
        self.out = out

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        self.out.append((len(ctx.history), ctx.last_output))
        return []

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass


def _seen(out: list[tuple[int, str]]) -> Callable[[str], Callable[[], Sequence[Predictor]]]:
    return lambda task: lambda: [_Seen(out)]


def test_each_turn_sees_what_the_previous_call_printed_online() -> None:
    groups = {"t": [_record("ls", "cat a", "python3 a.py")]}
    online = [_observed(0, 0, "ls", "a\n"), _observed(0, 1, "cat a", "print(1)\n"),
              _observed(0, 2, "python3 a.py", "1\n")]  # fmt: skip
    given, matched = with_observations(groups, online)
    assert matched == 3
    for run in (lambda m: evaluate(given, m), lambda m: replay(given, m)):
        out: list[tuple[int, str]] = []
        run(_seen(out))
        assert out == [(0, ""), (1, "a\n"), (2, "print(1)\n")]
    # the traces alone say nothing of what a call printed
    out = []
    replay(groups, _seen(out))
    assert out == [(0, ""), (1, ""), (2, "")]
    assert "observation" not in groups["t"][0]["steps"][1]  # the trace's records are not changed


def test_calls_are_matched_in_order_by_their_arguments_and_a_call_not_made_online_gets_nothing() -> None:
    # the trace's format error is no call; the online run made "pwd" where the trace has "ls -la"
    trace = _record("ls", extra=[{"tool": "bash", "kind": "format_error", "args": {}}])
    trace["steps"] += _record("ls -la", "ls")["steps"]
    online = [_observed(0, 0, "ls", "one\n"), _observed(0, 1, "pwd", "/w\n"), _observed(0, 2, "ls", "two\n")]
    given, matched = with_observations({"t": [trace]}, online)
    assert matched == 2
    assert [s.get("observation") for s in given["t"][0]["steps"]] == ["one\n", None, None, "two\n"]


def test_of_several_runs_the_first_or_the_configuration_asked_for() -> None:
    groups = {"t": [_record("ls")]}
    online = [_observed(0, 0, "ls", "first\n", "fork+cache"), _observed(0, 0, "ls", "spec\n", "fork+cache+spec")]
    assert with_observations(groups, online)[0]["t"][0]["steps"][0]["observation"] == "first\n"
    picked = with_observations(groups, online, config="fork+cache+spec")[0]
    assert picked["t"][0]["steps"][0]["observation"] == "spec\n"
    assert with_observations(groups, online, config="oracle") == ({"t": groups["t"]}, 0)


def test_an_observation_is_bounded_and_loses_the_exit_code_line_the_model_is_told(tmp_path: Path) -> None:
    assert bounded_output("exit code 1\nE: oops\n") == "E: oops\n"
    assert bounded_output("exit code 0\n") == ""
    assert bounded_output("no exit line\n") == "no exit line\n"
    long = "exit code 0\n" + "a" * OBSERVATION_CHARS + "tail"
    cut = bounded_output(long)
    assert cut.startswith("a" * 100) and cut.endswith("tail") and len(cut) < OBSERVATION_CHARS + 64
    path = tmp_path / "o.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(o) + b"\n" for o in [_observed(0, 0, "ls", "x")]) + b"\n")
    assert load_observations(path) == [_observed(0, 0, "ls", "x")]


def test_a_trajectory_the_agent_recorded_gives_its_observations_without_the_exit_code_line() -> None:
    record = _record("ls", "cat a")
    record["steps"][0]["observation"] = "exit code 0\na\n"  # as ``run_agent`` records what it told the model
    out: list[tuple[int, str]] = []
    replay({"t": [record]}, _seen(out))
    assert out == [(0, ""), (1, "a\n")]
