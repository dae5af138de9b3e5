"""The bundled task driven by the real agent loop against the replay server, and the experiment end to end."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench.experiment import main as cli_main
from bench.experiment._bundled import calc_task, calc_trajectories
from bench.experiment._cli import _padded_bash, trajectory_groups
from bench.experiment._runner import (
    CONFIGS,
    Config,
    ConfigResult,
    ReplayAgent,
    RolloutSummary,
    _result,
    _spec_counts,
    markdown_table,
    run_experiment,
    write_outputs,
)
from bench.experiment._runner import (
    config as named_config,
)
from bench.experiment._terminal import BUILD, PIP, TESTS, call_kind, padded_seconds
from bunshin_async import InvalidValue, Workspace
from bunshin_async._llm._replay import ReplayServer
from bunshin_async._llm._timing import RecordedTiming
from bunshin_async.rollout import GroupRollout, Step, Trajectory, dump_trajectories
from bunshin_async.tools import bash_tool


async def test_group_of_8_on_the_bundled_task_with_the_agent_loop() -> None:
    task = calc_task(kernel_mib=16)
    trajectories = calc_trajectories(8, seed=3, llm_median=0.1)
    async with ReplayServer(trajectories, timing=RecordedTiming(ttft=0.01)) as server:
        agent = ReplayAgent(server.base_url, lambda ctx: [bash_tool()], lambda ctx: f"replay:calc:{ctx.rollout}")
        try:
            async with GroupRollout(task, 8, agent) as group:
                results = [r async for r in group]
        finally:
            await agent.aclose()
    assert sorted(r.rollout for r in results) == list(range(8))
    for r in results:
        assert r.status == "finished" and r.fork_mode.startswith("criu") and r.trajectory is not None
        commands = [s.args["command"] for s in r.trajectory.steps if s.tool == "bash" and s.args]
        assert commands == [s.args["command"] for s in trajectories[r.rollout].steps if s.tool and s.args]
        assert r.reward == 1.0, r.reward_output  # every scripted attempt ends with the fix in place
        pip = next(s for s in r.trajectory.steps if s.args and "pip install" in s.args["command"])
        assert pip.exit_code == 0


async def test_the_experiment_end_to_end(tmp_path: Path) -> None:
    groups = [(calc_task(kernel_mib=16), calc_trajectories(2, seed=1, llm_median=0.05))]
    result = await run_experiment(groups, configs=["baseline", "fork", "fork+cache"], progress=lambda _: None)
    assert [c.name for c in result.configs] == ["baseline", "fork", "fork+cache"]
    assert result.same_calls_and_results
    for c in result.configs:
        assert c.peak_memory_mib > 0 and c.total_memory_gib_s > 0 and c.group_latency_s > 0
        assert [r.status for r in c.rollouts] == ["finished", "finished"]
    assert result.configs[0].setup_seconds and result.configs[1].setup_seconds
    assert result.configs[2].extra["cache"]["hits"] > 0  # the shared prefix's reads at least
    assert set(result.vs_baseline) == {"fork", "fork+cache"}
    assert "simulated" in result.models["llm"]
    paths = write_outputs(result, tmp_path)
    assert {p.name for p in paths} == {"experiment.json", "experiment.md", "memory.png", "latency.png"}
    assert json.loads((tmp_path / "experiment.json").read_text())["same_calls_and_results"] is True
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| fork |" in markdown_table(result)


def _bash(command: str, llm: float = 0.02) -> Step:
    return Step("bash", {"command": command}, llm_seconds=llm, tool_seconds=0.01)


def test_a_trajectory_file_replays_as_groups_and_an_unfinished_recording_as_truncated(tmp_path: Path) -> None:
    """Several rollouts of one task form a GRPO group (`--group-by task`, the default then); a recording that stops
    without a final answer (its agent hit its own limit) replays to its last call and ends truncated."""
    done = Step(None, None, llm_seconds=0.02, assistant_text="done")
    trajs = [
        Trajectory(task_id="t1", rollout=0, steps=[_bash("echo a > f"), _bash("cat f"), done]),
        Trajectory(task_id="t1", rollout=1, steps=[_bash("echo a > f"), _bash("ls")]),  # no final answer
        Trajectory(task_id="t2", rollout=0, steps=[_bash("echo b"), done]),
    ]
    path = dump_trajectories(tmp_path / "t.jsonl", trajs)
    rc = cli_main(["--trajectories", str(path), "--configs", "baseline,fork", "--time-scale", "0.5", "--pad-tools",
                   "--out", str(tmp_path / "out"), "--observations", str(tmp_path / "o.jsonl")])  # fmt: skip
    assert rc == 0
    # what every call of every run printed, for the offline replay
    printed = {(o["config"], o["task_id"], o["rollout"], o["index"], o["args"]["command"]): o["output"]
               for o in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())}  # fmt: skip
    assert printed == {
        (c, t, r, i, command): output
        for c in ("baseline", "fork")
        for t, r, i, command, output in [
            ("t1", 0, 0, "echo a > f", ""),
            ("t1", 0, 1, "cat f", "a\n"),
            ("t1", 1, 0, "echo a > f", ""),
            ("t1", 1, 1, "ls", "f\n"),
            ("t2", 0, 0, "echo b", "b\n"),
        ]  # fmt: skip
    }
    result = json.loads((tmp_path / "out" / "experiment.json").read_text())
    assert result["workload"]["group_by"] == "task" and result["workload"]["groups"] == 2
    assert result["same_calls_and_results"] is True
    for config in result["configs"]:
        rollouts = {(r["rollout"], tuple(r["calls"])): (r["status"], r["reason"]) for r in config["rollouts"]}
        assert rollouts == {
            (0, ("echo a > f", "cat f")): ("finished", None),
            (1, ("echo a > f", "ls")): ("truncated", "max_turns"),
            (0, ("echo b",)): ("finished", None),
        }, config["name"]
    fork = result["configs"][1]
    assert fork["setup_seconds"] is not None
    assert fork["forked"] == {"t1": False, "t2": False}  # nothing set up: nothing worth a fork (ForkRule)
    assert result["configs"][0]["forked"] == {"t1": False, "t2": False}  # the baseline never forks
    assert trajectory_groups(trajs, "rollout")[1][0].task_id == "t1:1"


async def test_a_padded_call_pads_by_its_command_not_by_call_order() -> None:
    """A call run out of order (speculated, or cancelled and run again) pads like the call the model asks for: the
    pad is looked up by command, so a call made first does not take another call's duration."""
    tool = _padded_bash(lambda task_id, rollout, command: 0.4 if command == "echo slow" else 0.0, 1.0)("t", 0)
    assert tool.handler is not None
    async with Workspace() as ws:
        for command in ["true", "echo slow", "true", "echo slow"]:
            t = time.monotonic()
            result = await tool.handler(ws, {"command": command})
            took = time.monotonic() - t
            assert result.exit_code == 0
            if command == "echo slow":
                assert took >= 0.4, took


@pytest.mark.unit
def test_terminal_pads_follow_the_traces_kinds_and_agree_everywhere() -> None:
    """The padded terminal workload: installs, tests and long runs get durations around the traces' per-kind
    medians, the same for the same command wherever it runs; reads and edits are not padded."""
    install = f"{PIP} ./vendor/fastcsv"
    assert call_kind(install) == "install" and call_kind(TESTS) == "test" and call_kind(BUILD) == "long run"
    assert call_kind("cat README.md") is None and padded_seconds("cat README.md") == 0.0
    assert padded_seconds(install) == padded_seconds(install)
    assert 28.5 / 8 < padded_seconds(install) < 28.5 * 8
    assert 1.2 / 8 < padded_seconds(TESTS) < 1.2 * 8


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "out"
    assert cli_main(["--quick", "--out", str(out), *args]) == 0
    result: dict[str, Any] = json.loads((out / "experiment.json").read_text())
    return result


@pytest.mark.timeout(1200)
def test_every_configuration_through_bunshin_bench_quick(tmp_path: Path) -> None:
    """`python -m bench.experiment --quick` on the bundled workload: baseline, fork, fork+cache, fork+cache+spec and
    oracle run side by side, with the same calls, results and final workspace states; the oracle predicts every call."""
    result = _bench(tmp_path)
    assert [c["name"] for c in result["configs"]] == list(CONFIGS)
    assert result["same_calls_and_results"] is True, result["differences"]
    for c in result["configs"]:
        assert [r["status"] for r in c["rollouts"]] == ["finished", "finished"], c["name"]
        assert all(r["final_state"] for r in c["rollouts"])
    by_name = {c["name"]: c for c in result["configs"]}
    oracle = by_name["oracle"]["extra"]["spec"]
    assert oracle["launched"] > 0 and oracle["committed"] > 0
    assert by_name["fork+cache+spec"]["extra"]["spec"]["calls"] == oracle["calls"]
    assert "| oracle |" in (tmp_path / "out" / "experiment.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_terminal_workload_through_bunshin_bench_quick(tmp_path: Path) -> None:
    """`python -m bench.experiment --workload terminal --quick --pad-tools`: real installs from the vendored sources,
    test runs, a build and a benchmark (padded), diverging after three calls; every configuration agrees on calls,
    results and final states, and every rollout ends with the tests passing (reward 1)."""
    result = _bench(tmp_path, "--workload", "terminal", "--pad-tools")
    assert result["workload"]["kind"] == "terminal" and result["workload"]["tools_padded"] is True
    assert "padded" in result["models"]["tools"]
    assert result["same_calls_and_results"] is True, result["differences"]
    for c in result["configs"]:
        assert [r["reward"] for r in c["rollouts"]] == [1.0, 1.0], c["name"]
    calls = result["configs"][0]["rollouts"][0]["calls"]
    assert calls[:3] == ["ls -la", "cat README.md", ".venv/bin/python -m unittest -q"]
    assert any("pip install" in c for c in calls) and calls[-2:] == [".venv/bin/python build.py",
                                                                       ".venv/bin/python bench.py"]  # fmt: skip


@pytest.mark.unit
def test_scrubbing_hides_repr_addresses_and_nothing_else() -> None:
    """Two runs of the same call print different addresses in Python's default reprs (where the allocator put the
    object); the equivalence check must not see that, and must still see every other difference."""
    import subprocess
    import sys

    from bench.experiment._runner import scrub

    code = "class A:\n    p = property(lambda s: 1)\nprint(A.p, object(), hex(3735928559))"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout for _ in range(2)]
    assert runs[0] != runs[1]  # ASLR: a different heap each run
    assert scrub(runs[0]) == scrub(runs[1])
    assert "0xdeadbeef" in scrub(runs[0])  # a hex value that is output, not an address, is kept
    assert scrub("<A object at 0x7f0123456789>") != scrub("<B object at 0x7f0123456789>")


@pytest.mark.unit
def test_scrubbing_hides_a_directorys_size_in_ls_and_not_a_files() -> None:
    """A directory's size in ``ls -l`` is its filesystem's bookkeeping (a tmpfs upper dir counts the entries made in
    it, so a copy's copied-up directory and its parent's differ); a regular file's size is content and stays."""
    from bench.experiment._runner import scrub

    parent = "drwxr-xr-x 1 root root  100 Dec  3 09:00 ..\n-rw-r--r-- 1 root root 12 Dec  3 09:00 notes.txt\n"
    copy = "drwxr-xr-x 1 root root   60 Dec  3 09:00 ..\n-rw-r--r-- 1 root root 12 Dec  3 09:00 notes.txt\n"
    assert scrub(parent) == scrub(copy)
    assert scrub(copy) != scrub(copy.replace(" 12 ", " 13 "))  # a file's size is still compared
    assert scrub(copy) != scrub(copy.replace("drwxr-xr-x", "drwx------"))  # and a directory's mode


@pytest.mark.unit
def test_scrubbing_hides_the_moment_in_ps_aux_and_not_the_processes() -> None:
    """A process's line in real ``ps aux`` output before and after it grew by 64 MiB: its RSS, VSZ and %MEM differ,
    as its %CPU, START and TIME do between a copy and its parent, and whether ps found it running or waiting (STAT's
    R, S, D: the load's); what the process is (user, pid, tty, a stopped or zombie state, STAT's flags, command) is
    still compared."""
    import subprocess
    import sys

    from bench.experiment._runner import scrub

    grow = (
        "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\nb = bytearray(64 << 20)\n"
        "print('grown', flush=True)\nsys.stdin.read()\n"
    )
    with subprocess.Popen([sys.executable, "-c", grow], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        assert p.stdin is not None and p.stdout is not None

        def line() -> str:
            # once it waits for its input (state S): a loaded machine may still run it just after it printed, and
            # ps's STAT would then say R
            for _ in range(10_000):  # a hang guard: it blocks within microseconds of its print
                if Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S":
                    break
                time.sleep(0.001)
            out = subprocess.run(["ps", "aux"], capture_output=True, text=True, check=True).stdout
            [mine] = [ln for ln in out.splitlines() if ln.split()[1] == str(p.pid)]
            return mine + "\n"

        assert p.stdout.readline() == "ready\n"
        before = line()
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline() == "grown\n"
        after = line()
        p.stdin.close()
    assert before != after  # RSS, VSZ
    assert scrub(before) == scrub(after)
    fields = after.split(None, 10)
    older = " ".join([*fields[:8], "Dec03", "12:34", fields[10]])  # START, TIME
    assert scrub(older) == scrub(after)
    for i, other in ((1, "1"), (7, "Z"), (7, "T"), (7, fields[7] + "+"), (10, "python3 other\n")):  # PID, STAT, COMMAND
        changed = " ".join([*fields[:i], other, *fields[i + 1 :]])
        assert scrub(changed) != scrub(after), other
    for state in "RSD":  # running or waiting at the moment ps read it (a loaded machine runs it later)
        moment = " ".join([*fields[:7], state + fields[7][1:], *fields[8:]])
        assert scrub(moment) == scrub(after), state


def _config_result(name: str, latency: float, groups: dict[str, float], gib_s: float, digests: list[str],
                   state: str = "s") -> ConfigResult:  # fmt: skip
    rollouts = [RolloutSummary(rollout=0, status="finished", reason=None, reward=1.0, wall_seconds=latency,
                               llm_seconds=0, tool_seconds=0, calls=["a", "b"], call_seconds=[0, 0],
                               results_digest="".join(digests), final_state=state, task_id="t",
                               step_digests=digests)]  # fmt: skip
    return ConfigResult(name=name, group_latency_s=latency, rollout_latency_s={}, setup_seconds=None,
                        peak_memory_mib=1, total_memory_gib_s=gib_s, cpu_seconds=1, rollouts=rollouts,
                        sdk_cpu_seconds=1, memory_timeline=[], group_latencies=groups)  # fmt: skip


@pytest.mark.unit
def test_the_share_of_the_oracles_gain_is_paired_per_repeat_and_volatile_results_are_named() -> None:
    """Per repeat, spec's gain over fork+cache and the oracle's; the share is the median gain over the oracle's.
    A step whose result differed between repeats of the baseline itself is not a difference (and is listed)."""
    runs = [
        [_config_result("baseline", 110, {"t": 110, "u": 60}, 2.0, ["x", "r1"]),
         _config_result("fork+cache", 100, {"t": 100, "u": 50}, 1.0, ["x", "r1"]),
         _config_result("fork+cache+spec", 95, {"t": 95, "u": 50}, 1.1, ["x", "r1"]),
         _config_result("oracle", 90, {"t": 90, "u": 40}, 1.2, ["x", "r1"])],
        [_config_result("baseline", 110, {"t": 110, "u": 60}, 2.0, ["x", "r2"]),
         _config_result("fork+cache", 100, {"t": 100, "u": 50}, 1.0, ["x", "r2"]),
         _config_result("fork+cache+spec", 97, {"t": 97, "u": 50}, 0.9, ["x", "r3"]),
         _config_result("oracle", 80, {"t": 80, "u": 40}, 1.0, ["x", "r2"], state="other")],
    ]  # fmt: skip
    result = _result(runs, {}, 1.0)
    spec = result.vs_fork_cache["fork+cache+spec"]
    assert spec["latency_gain"].median == pytest.approx(0.04) and spec["latency_gain"].min == pytest.approx(0.03)
    assert spec["oracle_latency_gain"].median == pytest.approx(0.15)
    assert spec["latency_oracle_share"] == pytest.approx(0.04 / 0.15, abs=1e-3)
    assert spec["mean_group_latency_gain"].median == pytest.approx(1 - 73 / 75, abs=1e-3)
    assert spec["gib_s_ratio"].median == pytest.approx(1.0)
    assert result.vs_fork_cache["oracle"]["latency_oracle_share"] == 1.0
    assert result.nondeterministic == ["t:0#1"]
    assert result.differences == ["oracle t#0: final state differs: "]  # step 1 is volatile; the state is not
    assert not result.same_calls_and_results
    table = markdown_table(result)
    assert "| fork+cache+spec | +4.0% [+3.0..+5.0] | +15.0% [+10.0..+20.0] | 27% |" in table
    assert "Not compared" in table
    assert named_config("fork+cache+spec-without-siblings+recent") == Config(
        "fork+cache+spec-without-siblings+recent", fork=True, cache=True, speculation=True,
        without=frozenset({"siblings", "recent"}))  # fmt: skip
    assert named_config("fork+cache+spec-without-") is None and named_config("nope") is None
    assert named_config("fork+cache-unweighed") == Config(
        "fork+cache-unweighed", fork=True, cache=True, speculation=False, weigh_captures=False)  # fmt: skip
    assert named_config("fork+cache+spec-without-recent-unweighed") == Config(
        "fork+cache+spec-without-recent-unweighed", fork=True, cache=True, speculation=True,
        without=frozenset({"recent"}), weigh_captures=False)  # fmt: skip
    assert named_config("fork-unweighed") is None  # no cache: nothing to weigh


@pytest.mark.unit
def test_a_speculative_configuration_at_turn_start_is_the_ablation_of_launching_on_the_observation() -> None:
    from types import SimpleNamespace

    from bench.experiment._runner import _oracle_factory, _speculation_factory

    assert named_config("oracle-at-turn-start") == Config(
        "oracle-at-turn-start", fork=True, cache=True, speculation=True, oracle=True, on_observation=False)  # fmt: skip
    assert named_config("fork+cache+spec-without-siblings-at-turn-start") == Config(
        "fork+cache+spec-without-siblings-at-turn-start", fork=True, cache=True, speculation=True,
        without=frozenset({"siblings"}), on_observation=False)  # fmt: skip
    assert named_config("fork+cache+spec") == Config("fork+cache+spec", fork=True, cache=True, speculation=True)
    assert named_config("fork+cache+spec").on_observation  # type: ignore[union-attr]
    for plain in ("fork+cache-at-turn-start", "baseline-at-turn-start", "-at-turn-start"):
        assert named_config(plain) is None, plain
    ctx: Any = SimpleNamespace(task=SimpleNamespace(task_id="t"), rollout=0)
    for on in (True, False):
        assert _speculation_factory(on_observation=on)(ctx).on_observation is on
        assert _oracle_factory([], on)(ctx).on_observation is on


@pytest.mark.timeout(1200)
def test_a_grouped_replay_reports_the_share_of_the_oracles_gain(tmp_path: Path) -> None:
    """A trajectory file replayed as GRPO groups (`--group-by task --pad-tools`), the configurations the issue
    compares: the report gives spec's and the oracle's latency gains over fork+cache, the share, per-group
    latencies, what each predictor's branches did, and the equivalence check holds."""
    slow = "sleep 0.3; echo done > out.txt"
    trajs = [
        Trajectory(task_id="t", rollout=i, steps=[_bash("ls"), _bash(f"echo {i} > f{i}"),
                                                   Step("bash", {"command": slow}, llm_seconds=0.5, tool_seconds=0.4),
                                                   _bash("cat out.txt"), Step(None, None, llm_seconds=0.02)])
        for i in range(2)
    ]  # fmt: skip
    path = dump_trajectories(tmp_path / "t.jsonl", trajs)
    configs = "baseline,fork+cache,fork+cache+spec,oracle"
    assert cli_main(["--trajectories", str(path), "--group-by", "task", "--pad-tools", "--configs", configs,
                     "--out", str(tmp_path / "out")]) == 0  # fmt: skip
    result = json.loads((tmp_path / "out" / "experiment.json").read_text())
    assert result["same_calls_and_results"] is True, result["differences"]
    assert result["workload"]["tasks"] == ["t"] and result["workload"]["rollouts"] == 2
    for name in ("fork+cache+spec", "oracle"):
        entry = result["vs_fork_cache"][name]
        assert {"latency_gain", "oracle_latency_gain", "latency_oracle_share", "gib_s_ratio"} <= set(entry)
    assert result["vs_fork_cache"]["oracle"]["latency_oracle_share"] == 1.0 or (
        result["vs_fork_cache"]["oracle"]["oracle_latency_gain"]["median"] <= 0
    )
    by_name = {c["name"]: c for c in result["summary"]}
    assert set(by_name["oracle"]["by_source"]) == {"oracle"}
    assert by_name["oracle"]["by_source"]["oracle"]["committed"] > 0
    assert all(set(c["group_latencies"]) == {"t"} for c in result["configs"])
    assert "share of oracle's" in (tmp_path / "out" / "experiment.md").read_text()


@pytest.mark.unit
def test_tasks_select_groups_by_task_id_in_file_order_and_an_unknown_one_is_an_error() -> None:
    from bench.experiment._cli import select_groups

    def traj(task: str, seconds: float) -> Trajectory:
        return Trajectory(
            task_id=task, steps=[Step("bash", {"command": "true"}, llm_seconds=seconds), Step(None, None)]
        )

    groups = trajectory_groups([traj("a", 1), traj("b", 50), traj("c", 2), traj("c", 3)], "task")
    assert [t.task_id for t, _ in select_groups(groups, None, None, ["c", "b"])] == ["b", "c"]
    assert [t.task_id for t, _ in select_groups(groups, None, 10, ["c", "b"])] == ["c"]  # both filters apply
    with pytest.raises(ValueError, match="'x'"):
        select_groups(groups, None, None, ["a", "x"])


@pytest.mark.unit
def test_unweighed_forks_is_a_speculative_configuration_whose_policy_ignores_the_gib_seconds_rule() -> None:
    from types import SimpleNamespace

    from bench.experiment._runner import _oracle_factory, _speculation_factory

    assert named_config("oracle-unweighed-forks") == Config(
        "oracle-unweighed-forks", fork=True, cache=True, speculation=True, oracle=True, weigh_forks=False)  # fmt: skip
    both = named_config("fork+cache+spec-unweighed-forks-at-turn-start")
    assert both is not None and not both.weigh_forks and not both.on_observation
    for plain in ("fork+cache-unweighed-forks", "baseline-unweighed-forks", "-unweighed-forks"):
        assert named_config(plain) is None, plain
    ctx: Any = SimpleNamespace(task=SimpleNamespace(task_id="t"), rollout=0)
    for weigh in (True, False):
        assert _speculation_factory(weigh_forks=weigh)(ctx).policy.memory_weight == float(weigh)
        assert _oracle_factory([], weigh_forks=weigh)(ctx).policy.memory_weight == float(weigh)


@pytest.mark.unit
async def test_odd_repeats_run_the_configurations_reversed_and_the_pairs_stay_per_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The order is counterbalanced (a configuration that always runs after another must not gain from it) and
    recorded; results stay in the listed order, so that each repeat's ratios pair the same repeat's runs."""
    from bench.experiment import _runner

    names = ["baseline", "fork+cache", "fork+cache+spec"]
    ran: list[str] = []

    async def fake_run_config(config: Config, groups: Any, **kwargs: Any) -> ConfigResult:
        ran.append(config.name)
        latency = {"baseline": 200.0, "fork+cache": 100.0, "fork+cache+spec": 90.0}[config.name]
        latency += 10 * len(ran)  # a host that slows down as the run goes on: later runs take longer
        return _config_result(config.name, latency, {"t": latency}, 1.0, ["x"])

    monkeypatch.setattr(_runner, "run_config", fake_run_config)
    result = await run_experiment([], configs=names, repeats=4, progress=lambda _: None)
    forward, backward = names, names[::-1]
    assert ran == forward + backward + forward + backward
    assert result.orders == [forward, backward, forward, backward]
    assert [c.name for c in result.configs] == names
    assert all([c.name for c in run] == names for run in result.later_repeats)
    # Paired within each repeat: spec ran right after fork+cache (10 s slower host) on forward repeats, right
    # before it on backward ones; the gains are those of the same repeat's two runs (repeat r's runs are 3r+1..3r+3).
    gains = [1 - (90 + 10 * (3 * r + 3)) / (100 + 10 * (3 * r + 2)) for r in (0, 2)]
    gains += [1 - (90 + 10 * (3 * r + 1)) / (100 + 10 * (3 * r + 2)) for r in (1, 3)]
    gain = result.vs_fork_cache["fork+cache+spec"]["latency_gain"]
    assert (gain.min, gain.max) == (pytest.approx(min(gains), abs=1e-3), pytest.approx(max(gains), abs=1e-3))
    assert gain.median == pytest.approx(statistics.median(gains), abs=1e-3)
    assert _runner.run_order(names, 0) == forward and _runner.run_order(names, 7) == backward
    with pytest.raises(InvalidValue):
        _runner.run_order(["fork", "fork"], 0)


async def test_sigterm_stops_the_experiment_and_closes_every_workspace() -> None:
    """SIGTERM (``kill``, ``pkill``, ``timeout``) would end Python at once, its workspaces left behind: the
    experiment cancels its run instead, so every workspace it made is closed when it exits (143, 128 + SIGTERM)."""
    import os
    import signal
    import subprocess
    import sys

    import anyio

    from bunshin_async._host import _paths

    run = _paths.workspaces_dir()
    before = set(run.iterdir()) if run.exists() else set()
    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "bench.experiment", "--quick", "--configs", "fork", "--out", "/nonexistent"]
    async with await anyio.open_process(argv, cwd=root, env=dict(os.environ), stderr=subprocess.PIPE) as proc:
        with anyio.fail_after(120):
            while not (set(run.iterdir()) - before if run.exists() else set()):  # noqa: ASYNC110 - a state
                assert proc.returncode is None
                await anyio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        err = ""
        with anyio.fail_after(60):
            async for chunk in proc.stderr:
                err += chunk.decode(errors="replace")
            code = await proc.wait()
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM: stopping" in err
    assert set(run.iterdir()) == before


@pytest.mark.unit
def test_the_ngram_predictors_are_opt_in() -> None:
    """fork+cache+spec speculates without ``history`` and ``signatures`` (offline they hid nothing on the
    terminal-benchmark traces and ran wrong calls); ``-with-ngram`` puts them back, for an A/B."""
    from types import SimpleNamespace

    from bench.experiment._runner import _speculation_factory

    assert named_config("fork+cache+spec-with-ngram") == Config(
        "fork+cache+spec-with-ngram", fork=True, cache=True, speculation=True, ngram=True)  # fmt: skip
    both = named_config("fork+cache+spec-without-recent-with-ngram-at-turn-start")
    assert both is not None and both.ngram and both.without == {"recent"} and not both.on_observation
    for plain in ("oracle-with-ngram", "fork+cache-with-ngram", "-with-ngram"):
        assert named_config(plain) is None, plain
    ctx: Any = SimpleNamespace(task=SimpleNamespace(task_id="t"), rollout=0)
    default = [p.name for p in _speculation_factory()(ctx).predictors]
    assert "siblings" in default and not {"history", "signatures"} & set(default)
    with_ngram = [p.name for p in _speculation_factory(ngram=True)(ctx).predictors]
    assert with_ngram == [*default, "history", "signatures"]


@pytest.mark.unit
def test_stated_odds_is_speculation_without_the_factors_by_kind_of_call() -> None:
    from types import SimpleNamespace

    from bench.experiment._runner import _speculation_factory
    from speculator import KindOdds

    assert named_config("fork+cache+spec-stated-odds") == Config(
        "fork+cache+spec-stated-odds", fork=True, cache=True, speculation=True, kind_odds=False)  # fmt: skip
    both = named_config("fork+cache+spec-with-ngram-stated-odds")
    assert both is not None and both.ngram and not both.kind_odds
    assert named_config("oracle-stated-odds") is None and named_config("fork+cache-stated-odds") is None
    ctx: Any = SimpleNamespace(task=SimpleNamespace(task_id="t"), rollout=0)
    assert any(isinstance(p, KindOdds) for p in _speculation_factory()(ctx).predictors)
    assert not any(isinstance(p, KindOdds) for p in _speculation_factory(kind_odds=False)(ctx).predictors)


@pytest.mark.unit
def test_on_a_trace_file_each_task_gets_odds_fitted_on_the_other_tasks(tmp_path: Path) -> None:
    """KIND_ODDS is fitted on the development traces: measured on them, every group's predictors use factors
    fitted on the file's other tasks (``held_out_odds``), named as the experiment names the group."""
    from types import SimpleNamespace

    from bench.experiment._cli import _held_out_odds
    from bench.experiment._runner import _speculation_factory
    from bunshin_async.rollout import load_trajectories
    from speculator import KIND_ODDS, KindOdds, held_out_odds
    from speculator._offline import load_groups

    commands = ["ls", "python3 a.py", "python3 b.py", "cat > c.txt", "python3 c.py"]
    path = tmp_path / "t.jsonl"
    with path.open("w") as f:
        for task in ("a", "b", "c"):
            for r in range(2):
                steps = [{"tool": "bash", "args": {"command": c}, "llm_seconds": 2.0, "tool_seconds": 1.0 + r}
                         for c in commands[: 3 + r] + ([f"python3 {task}.py"] if task != "c" else [])]  # fmt: skip
                f.write(json.dumps({"task_id": task, "rollout": r, "steps": steps}) + "\n")
    trajs = load_trajectories(path)
    expected = held_out_odds(load_groups(path))
    assert _held_out_odds(path, trajs, "task") == expected
    assert _held_out_odds(path, trajs, "rollout") == {f"{t}:{r}": expected[t] for t in "abc" for r in range(2)}
    assert _held_out_odds(path, trajs[:2], "task") == held_out_odds({"a": load_groups(path)["a"]})  # --limit 2
    # given what an online run printed: fitted on the guesses the predictors make seeing it
    from speculator._offline import ObservedCall, with_observations

    printed = [ObservedCall(config="fork+cache", repeat=1, task_id=t, rollout=r, index=i, tool="bash",
                            args={"command": c}, exit_code=1, output=f"ModuleNotFoundError: No module named '{t}x'\n")
               for t in "abc" for r in range(2) for i, c in enumerate(commands[:3])]  # fmt: skip
    observed = tmp_path / "o.jsonl"
    observed.write_bytes(b"".join(msgspec.json.encode(o) + b"\n" for o in printed))
    seen = held_out_odds(with_observations(load_groups(path), printed)[0])
    assert seen != expected and "observation-form" in seen["a"]  # its guesses of installs, all wrong, are fitted
    assert _held_out_odds(path, trajs, "task", observed) == seen

    def siblings(task: str, **kwargs: Any) -> Any:
        ctx: Any = SimpleNamespace(task=SimpleNamespace(task_id=task), rollout=0)
        return next(p for p in _speculation_factory(**kwargs)(ctx).predictors if p.name == "siblings")

    odds = {"a": {"siblings": {"run": 0.5}}}
    assert isinstance(siblings("a", odds=odds), KindOdds) and siblings("a", odds=odds).factors == {"run": 0.5}
    assert siblings("z", odds=odds).factors == KIND_ODDS["siblings"]  # a task the file did not have: the shipped
    assert not isinstance(siblings("a", odds=odds, kind_odds=False), KindOdds)


@pytest.mark.unit
def test_the_spec_figures_say_what_the_memory_allowance_earned_and_has_left() -> None:
    """The run's launch rule spends on forks that do not pay alone at most ``memory_share`` of what its rollouts
    held (``speculator._allowance``): the experiment's ``spec`` figures show that share and what is left, MiB·s."""
    from bunshin_async.speculation import Speculation
    from speculator import CostAwarePolicy

    policy = CostAwarePolicy(memory_share=0.1)
    policy.allowance.earned = 300 * 2**20  # the rollouts held 300 MiB·s
    policy.allowance.spent = 12 * 2**20  # its forks cost 12 by the rule's terms
    out = _spec_counts([Speculation(predictors=[], policy=policy)])
    assert (out["policy_allowance_mib_s"], out["policy_allowance_left_mib_s"]) == (30.0, 18.0)


@pytest.mark.unit
def test_what_every_call_printed_is_written_bounded_and_scrubbed_per_rollout_and_call() -> None:
    """``--observations``: one line per call (not the final answer), what the runtime's ``last_output`` holds (no
    ``exit code`` line), scrubbed as the results' digests are, read back by ``speculator._offline``."""
    import io

    from bench.experiment._runner import _observed_to
    from bunshin_async._rollout._rollout import RolloutResult
    from speculator._offline import OBSERVATION_CHARS, ObservedCall

    steps = [
        Step("bash", {"command": "ls -l"}, observation="exit code 0\n-rw-r--r-- 1 root root 3 Dec  4 10:00 x\n",
             exit_code=0),
        Step("bash", {"command": "cat big"}, observation="exit code 1\n" + "b" * (3 * OBSERVATION_CHARS), exit_code=1),
        Step(None, None, assistant_text="done"),
    ]  # fmt: skip
    done = RolloutResult(task_id="t", rollout=2, status="finished", loss_mask=1.0,
                         trajectory=Trajectory(task_id="t", steps=steps))  # fmt: skip
    failed = RolloutResult(task_id="u", rollout=0, status="failed", loss_mask=0.0)  # no trajectory: nothing
    sink = io.BytesIO()
    _observed_to(sink, "fork+cache", 3)([done, failed])
    lines = [msgspec.json.decode(line, type=ObservedCall) for line in sink.getvalue().splitlines()]
    assert [(o.config, o.repeat, o.task_id, o.rollout, o.index, o.args["command"], o.exit_code) for o in lines] == [
        ("fork+cache", 3, "t", 2, 0, "ls -l", 0),
        ("fork+cache", 3, "t", 2, 1, "cat big", 1),
    ]
    assert lines[0].output == "-rw-r--r-- 1 root root 3 ~ x\n"  # the file's time scrubbed
    assert lines[1].output.startswith("bbb") and len(lines[1].output) < OBSERVATION_CHARS + 64
