"""Predictions that create lead time, through ``run_agent`` on real workspaces and forks: an install predicted
from an import error (committed when the model asks for it, rolled back without a trace when it asks for something
else), a near miss committed through a provably safe output filter, and the policy backing off under a full CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest

from bunshin_async import Workspace
from bunshin_async._runtime._nearmiss import apply_tail, filtered, tail_lines
from bunshin_async.speculation import CallKey, Candidate, Launch, PredictionContext, Speculation
from bunshin_async.tools import Effect, bash_tool, builtin_tools
from speculator import (
    CostAwarePolicy,
    ObservationPredictor,
    RecentPredictor,
    Rule,
    RulePredictor,
    SiblingPredictor,
    SiblingTable,
    cpu_contention,
    loop_load,
)

from .agent_loop import agent_rollout, held_client, signalling_tools
from .conftest import bash, final, trajectory

TOOLS = builtin_tools()
BASH = bash_tool()
INSTALL = "sleep 0.8; mkdir -p lib/{m} && echo 'VERSION = 1' > lib/{m}/__init__.py"
IMPORT = "PYTHONPATH=lib python3 -c 'import {m}; print({m}.VERSION)'"


def _install_script(then: str) -> list[Any]:
    return [
        bash(IMPORT.format(m="alpha"), llm=0.05),  # ModuleNotFoundError: No module named 'alpha'
        bash(INSTALL.format(m="alpha"), llm=0.05),  # the rollout's own install: a template for the next one
        bash(IMPORT.format(m="beta"), llm=0.05),  # ModuleNotFoundError: No module named 'beta'
        bash(then, llm=1.2),  # the model thinks for 1.2 s, then asks for the install (or for something else)
        bash("ls -R lib; ps -eo args= | grep -c '[s]leep 0.8' || true", llm=0.05),
        final(),
    ]


def _observation_speculation() -> Speculation:
    table = SiblingTable()
    policy = CostAwarePolicy(contention=None, loop_load=None, default_seconds=1.0, memory_weight=0.0)
    return Speculation(predictors=[ObservationPredictor(table)], policy=policy, group="obs")


@pytest.mark.parametrize("asks_for_it", [True, False])
async def test_an_install_predicted_from_an_import_error(serve: Any, asks_for_it: bool) -> None:
    then = INSTALL.format(m="beta") if asks_for_it else "echo other > other.txt"
    steps = _install_script(then)
    async with serve([trajectory("obs", steps)]) as client:
        async with Workspace() as ws0:
            off = await agent_rollout(client, "replay:obs", ws0, TOOLS, None)
        # the model's answer for turn 3 is held until the predicted install started: under load a fork took
        # longer than the turn's 1.2 s, and the install was asked for before it ran
        tools, started = signalling_tools(TOOLS, INSTALL.format(m="beta"))
        held = held_client(client, 4, started)
        try:
            async with Workspace() as ws1:
                spec = _observation_speculation()
                on = await agent_rollout(held, "replay:obs", ws1, tools, spec)
        finally:
            await held.close()
    assert "No module named 'beta'" in on.calls[2].outcome
    assert on.calls == off.calls and on.final_state == off.final_state
    [branch] = [b for t in on.turns for b in t.branches]
    assert branch.source == "observation" and branch.effect == "write"
    if asks_for_it:
        assert branch.outcome == "committed" and on.moved
        assert branch.saved_seconds > 0  # launched when turn 3 started, it ran while the model thought
        assert "beta" in on.calls[4].outcome
    else:
        assert branch.outcome == "wasted" and not on.moved
        assert "beta" not in on.calls[4].outcome  # rolled back: no lib/beta, no process left
        assert on.calls[4].outcome.endswith("\n0\n")


async def test_a_near_miss_through_tail_returns_what_the_filtered_command_returns(serve: Any) -> None:
    inner = "ls /workspace /etc /nonexistent"  # stdout, stderr and exit code 2: the pipeline exits 0
    steps = [bash("mkdir -p d && touch d/x", llm=0.05), bash(f"{inner} | tail -n 3", llm=0.8), final()]
    rule = Rule(after="touch", then_tool="bash", then_args={"command": inner}, probability=0.9, expected_seconds=1.0)
    spec = Speculation(
        predictors=[RulePredictor([rule])], policy=CostAwarePolicy(contention=None, loop_load=None, memory_weight=0.0)
    )
    async with serve([trajectory("near", steps)]) as client:
        async with Workspace() as ws0:
            off = await agent_rollout(client, "replay:near", ws0, TOOLS, None)
            direct = await ws0.exec(f"{inner} | tail -n 3")
        async with Workspace() as ws1:
            on = await agent_rollout(client, "replay:near", ws1, TOOLS, spec)
    assert on.calls == off.calls and on.final_state == off.final_state
    assert on.calls[1].outcome == f"exit code 0\n{direct.stdout}{direct.stderr}" and direct.exit_code == 0
    assert "No such file" in direct.stderr and direct.stdout.count("\n") == 3
    [branch] = [b for t in on.turns for b in t.branches]
    assert branch.outcome == "committed" and on.metrics.committed == 1


@pytest.mark.unit
def test_the_filter_is_matched_only_where_it_is_provably_safe() -> None:
    def f(command: str) -> tuple[str, int] | None:
        got = filtered(BASH, CallKey.of(BASH, {"command": command}))
        return (got[0].arguments()["command"], got[1]) if got else None

    assert f("pytest -q | tail -n 50") == ("pytest -q", 50)
    assert f("make test 2>/dev/null|tail -5") is None  # a redirection: not only a filter of stdout
    for unsafe in ("a && b | tail -n 5", "a; b | tail -n 5", "a | b | tail -n 5", "a > f | tail -n 5",
                   "a & tail -n 5", "echo `x` | tail -n 2", "a | tail -n 5 | cat", "a | tail -f x"):  # fmt: skip
        assert f(unsafe) is None, unsafe
    # tail's own semantics, checked against tail itself
    for text in ("", "a", "a\n", "a\nb\nc", "a\nb\nc\n", "\n\n\n", "x\r\ny\n"):
        for n in (0, 1, 2, 5):
            real = subprocess.run(["tail", "-n", str(n)], input=text.encode(), capture_output=True, check=True)
            assert tail_lines(text, n) == real.stdout.decode(), (text, n)
    from bunshin_async import ExecResult

    assert apply_tail(ExecResult(exit_code=3, stdout="a\nb\n", stderr="e", duration=0.1), None, 1) == ExecResult(
        exit_code=0, stdout="b\n", stderr="e", duration=0.1
    )
    truncated = ExecResult(exit_code=0, stdout="a\n", stderr="", duration=0.1, truncated=True)
    assert apply_tail(truncated, None, 1) is None


def _ctx(*calls: str, last_output: str = "") -> PredictionContext:
    history = tuple(CallKey.of(BASH, {"command": c}) for c in calls)
    chain = "\n".join(calls).encode()
    return PredictionContext(history=history, chain=chain, turn=len(calls), position=0, last_output=last_output)


@pytest.mark.unit
def test_observation_templates_fill_in_the_module_of_an_import_error() -> None:
    table = SiblingTable()
    sibling, mine = ObservationPredictor(table), ObservationPredictor(table)
    error = "Traceback ...\nModuleNotFoundError: No module named 'fastcsv'\n"
    sibling.observe(_ctx("python -m unittest", last_output=error), CallKey.of(BASH, {"command": "pip install fastcsv"}))
    # a sibling's template, filled with the module this rollout's error names
    [cand] = mine.predict(_ctx("python -m unittest", last_output=error.replace("fastcsv", "colstats.core")))
    assert cand.arguments["command"] == "pip install colstats" and cand.source == "observation"
    mine.observe(_ctx(last_output=error), CallKey.of(BASH, {"command": "pip install -q ./vendor/fastcsv"}))
    top = mine.predict(_ctx(last_output="No module named 'colstats'"))[0]  # its own spelling first
    assert top.arguments["command"] == "pip install -q ./vendor/colstats" and top.probability == 0.5
    assert mine.predict(_ctx(last_output="all good")) == []
    # a script that names the module in passing is no template: the next import error does not predict it
    other = ObservationPredictor(SiblingTable())
    script = "cat > repro.py <<'EOF'\nimport fastcsv\nprint(fastcsv.read('a.csv'))\nEOF"
    other.observe(_ctx(last_output=error), CallKey.of(BASH, {"command": script}))
    assert other.predict(_ctx(last_output="No module named 'colstats'")) == []
    # a read between the error and the install: the install is still a template of the rollout's own spelling
    reader = ObservationPredictor(SiblingTable())
    reader.observe(_ctx(last_output=error), CallKey.of(BASH, {"command": "cat csvtool/core.py"}))
    reader.observe(_ctx(last_output="import fastcsv\n"), CallKey.of(BASH, {"command": "pip3 install vendor/fastcsv"}))
    [cand] = reader.predict(_ctx(last_output="No module named 'colstats'"))
    # (the group's only form so far: its siblings' odds, which count the rollout's own uses too)
    assert cand.arguments["command"] == "pip3 install vendor/colstats" and cand.probability == 0.7
    other.observe(_ctx(last_output=error), CallKey.of(BASH, {"command": "pip install fastcsv"}))
    assert [c.arguments["command"] for c in other.predict(_ctx(last_output="No module named 'x1'"))] == [
        "pip install x1"
    ]


@pytest.mark.unit
def test_recent_runs_after_an_edit_and_siblings_after_the_same_call() -> None:
    recent = RecentPredictor()
    cands = recent.predict(_ctx("python -m unittest -q", "cat a.py", "sed -i s/a/b/ a.py"))
    assert [c.arguments["command"] for c in cands] == ["python -m unittest -q"]
    assert recent.predict(_ctx("python -m unittest -q", "cat a.py")) == []  # no edit, no re-run
    # an install changes what the last run failed on: re-run it (installs themselves are never the run repeated)
    after_install = recent.predict(_ctx("python -m unittest -q", "python -m pip install a", "pip install -q ./b"))
    assert [c.arguments["command"] for c in after_install] == ["python -m unittest -q"]
    assert [c.arguments["command"] for c in recent.predict(_ctx("npm test", "npm add left-pad"))] == ["npm test"]
    assert recent.predict(_ctx("npm install", "sed -i s/a/b/ x.js")) == []
    assert recent.predict(_ctx("python -m unittest -q", "pip list")) == []  # not an install
    table = SiblingTable()
    built = _ctx("ls", "python build.py", last_output="built\n")
    SiblingPredictor(table).observe(built, CallKey.of(BASH, {"command": "python bench.py"}))
    # another history, same previous call (which printed something else): what the sibling did after it
    [cand] = SiblingPredictor(table).predict(_ctx("cat README", "python build.py", last_output="built, 1 warning\n"))
    assert cand.arguments["command"] == "python bench.py" and cand.probability == pytest.approx(0.2)


@pytest.mark.unit
def test_siblings_after_the_same_call_that_printed_the_same_thing() -> None:
    table = SiblingTable()
    sibling, mine = SiblingPredictor(table), SiblingPredictor(table)
    tests, build, install = (CallKey.of(BASH, {"command": c}) for c in ("make test", "make build", "pip install x"))
    passed = "Ran 5 tests in 0.003s\n\nOK\n"
    failed = "ModuleNotFoundError: No module named 'x'\nRan 5 tests in 0.001s\n\nFAILED (errors=1)\n"
    sibling.observe(_ctx("ls", "make test", last_output=failed), install)
    sibling.observe(_ctx("ls", "make test", "pip install x", "make test", last_output=passed), build)
    # another history: after the same test run, what the sibling did when it printed the same (timings aside)
    [cand] = mine.predict(_ctx("cat README", "make test", last_output=passed.replace("0.003", "0.417")))
    assert cand.arguments["command"] == "make build" and cand.probability == pytest.approx(0.8)
    [cand] = mine.predict(_ctx("cat README", "make test", last_output=failed))
    assert cand.arguments["command"] == "pip install x"
    # an output no sibling saw: what followed the call whatever it printed, less sure
    cands = mine.predict(_ctx("cat README", "make test", last_output="Segmentation fault\n"))
    assert {c.arguments["command"] for c in cands} == {"make build", "pip install x"}
    assert all(c.probability == pytest.approx(0.1) for c in cands)
    # a later call of a message (the one before it may still run): its output is not the observation
    later = msgspec.structs.replace(_ctx("cat README", "make test", last_output=passed), position=1, decided=(tests,))
    assert [c.probability for c in mine.predict(later)] == pytest.approx([0.1, 0.1])


def test_under_a_full_cpu_the_policy_backs_off() -> None:
    def launch(p: float, seconds: float = 2.0) -> Launch:
        cand = Candidate(name="bash", arguments={"command": "make"}, probability=p, expected_seconds=seconds)
        return Launch(candidate=cand, key=CallKey.of(BASH, {"command": "make"}), effect=Effect.WRITE)

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        deadline = time.monotonic() + 20  # until the hogs' interpreters have started and run
        while (busy := cpu_contention()) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)
        loaded = CostAwarePolicy(memory_weight=0.0)  # reads the real run queue; the CPU term alone
        coin, likely = launch(0.5), launch(0.95)
        assert busy == 1.0
        assert loaded.select([coin], running=0, forks=0) == []  # a wrong guess would take CPU from the rollouts
        assert loaded.select([likely], running=0, forks=0) == [likely]
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    idle = CostAwarePolicy(contention=lambda: 0.0, memory_weight=0.0)
    assert idle.select([coin], running=0, forks=0) == [coin]
    # the saving is capped by the LLM time a launch can still hide
    idle.observe_llm(0.1)
    for _ in range(20):
        idle.observe_llm(0.1)
    assert idle.llm_seconds < 0.5
    # not 0.9 x 10 s; a miss's CPU (unmeasured: a full CPU) charged at the floor of contention
    assert idle.saving(launch(0.9, 10.0)) == pytest.approx(0.9 * idle.llm_seconds - 0.2 - 0.1 * 10.0 * 0.5)


class _Clocks:
    """``time`` for the loop meter: wall and thread CPU seconds that the test advances."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def monotonic(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu


@pytest.mark.unit
def test_loop_load_is_the_share_of_wall_time_the_calling_thread_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    from speculator import _policy

    clocks = _Clocks()
    monkeypatch.setattr(_policy, "time", clocks)
    monkeypatch.setattr(_policy, "_METER", _policy._LoopMeter())
    for _ in range(10):  # 5 s in which the thread computes without a pause: a CPU second per wall second
        clocks.wall += 0.5
        clocks.cpu += 0.5
        assert loop_load() == _policy._METER.value  # read within a window: the last value
    busy = loop_load()
    assert busy > 0.85
    clocks.wall += 0.5  # half a window: no new reading
    assert loop_load() == busy
    for _ in range(4):  # and then waits
        clocks.wall += 1.05
        idle = loop_load()
    assert idle < 0.1
    monkeypatch.undo()
    # the real meter by default (whether it reads below 0.8 now depends on what this thread computed in the last
    # seconds, another test's work included: not asserted)
    assert CostAwarePolicy().loop_load is loop_load
    assert not CostAwarePolicy(loop_load=lambda: busy, max_loop_load=0.8).active()
    assert CostAwarePolicy(loop_load=None).active()
