"""``python -m bench.experiment``: run the experiment on the bundled workload or on a trajectory file."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from bunshin_async._rollout._rollout import Budget, RolloutContext, Task
from bunshin_async._rollout._trajectory import Trajectory, load_trajectories
from bunshin_async._tools._tools import Tool, bash_tool

from ._bundled import calc_task, calc_trajectories
from ._runner import (
    ABLATION,
    AT_TURN_START,
    CONFIGS,
    STATED_ODDS,
    UNWEIGHED,
    UNWEIGHED_FORKS,
    WITH_NGRAM,
    ExperimentResult,
    config,
    markdown_table,
    run_experiment,
    write_outputs,
)
from ._terminal import PADS, padded_seconds, terminal_task, terminal_trajectories


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--configs", default=",".join(CONFIGS),
        help="comma-separated, baseline first; a speculative one + '-at-turn-start' launches a turn's first call "
        "when the turn starts, not on the previous turn's last observation (e.g. oracle-at-turn-start); + "
        "'-unweighed-forks' launches forks without the GiB·s rule (e.g. oracle-unweighed-forks); a predicting one + "
        "'-with-ngram' adds the n-gram predictors (history, signatures; off by default), + '-stated-odds' uses the "
        "predictors' own odds (no factors by kind of call)",
    )  # fmt: skip
    p.add_argument(
        "--workload", choices=["bundled", "terminal"], default="bundled",
        help="bundled: the calc task (8 rollouts sharing their slow calls); terminal: shaped like timed terminal-"
        "benchmark traces (rollouts diverge after 3 calls; installs, test runs, a build and a benchmark)",
    )  # fmt: skip
    p.add_argument("-n", "--rollouts", type=int, help="rollouts per group (default: 8 bundled, 4 terminal)")
    p.add_argument("--groups", type=int, default=1, help="concurrent groups (bundled and terminal workloads)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies recorded LLM (and padded tool) times")
    p.add_argument("--llm-median", type=float, help="median LLM seconds per turn (default: 1.5 bundled, 3.3 terminal)")
    p.add_argument(
        "--kernel-mib", type=int, help="memory of the task's warm interpreter (MiB; 256 bundled, 64 terminal)"
    )
    p.add_argument("--work", type=float, help="terminal workload: scales its build's and benchmark's CPU work (1.0)")
    p.add_argument("--repeats", type=int, default=1, help="paired repeats of every configuration (medians, spread)")
    p.add_argument(
        "--quick", action="store_true",
        help="a smoke run: 2 rollouts, 16 MiB interpreter, LLM times x 0.02 (unless given), one repeat, a fifth of "
        "the terminal task's build and benchmark work",
    )  # fmt: skip
    p.add_argument("--trajectories", type=Path, help="replay this JSONL(.gz) trajectory file instead")
    p.add_argument("--limit", type=int, default=40, help="trajectories taken from --trajectories")
    p.add_argument(
        "--pad-tools", action="store_true",
        help="pad each tool call to its recorded duration (--trajectories) or, on the terminal workload, to a "
        "duration drawn from the timed traces' per-kind distribution (installs, tests, long runs; sleep, stated)",
    )  # fmt: skip
    p.add_argument(
        "--group-by", choices=["task", "rollout"], default=None,
        help="--trajectories: 'task' replays the rollouts of one task_id as a GRPO group (one set-up, forked); "
        "'rollout' makes each trajectory its own group (default: 'task' when some task has several rollouts)",
    )  # fmt: skip
    p.add_argument("--max-groups", type=int, help="--trajectories: replay only the first N groups (file order)")
    p.add_argument(
        "--tasks",
        help="--trajectories: replay only the groups of these comma-separated task ids (file order kept; an "
        "unknown id is an error): e.g. the long-tool groups, stated in the output",
    )  # fmt: skip
    p.add_argument(
        "--max-rollout-seconds", type=float,
        help="--trajectories: replay only the groups whose longest rollout's recorded LLM + tool time is at most "
        "this (before --time-scale): a subset that fits a time budget, stated in the output",
    )  # fmt: skip
    p.add_argument(
        "--decisions",
        type=Path,
        help="write each speculative run's policy decisions (every option, its verdict and the rule's figures) to "
        "DIR/<configuration>-<repeat>.jsonl",
    )
    p.add_argument(
        "--observations",
        type=Path,
        help="write what every call of every run printed (bounded, scrubbed; JSON lines, speculator's ObservedCall) "
        "to this file, for the offline replay (scripts/eval_predictors.py --observations)",
    )
    p.add_argument(
        "--odds-observations",
        type=Path,
        help="--trajectories: fit the held-out odds by kind of call on the guesses the predictors make given what "
        "an earlier run printed (a file --observations wrote), as they see it online",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results"))


Pad = Callable[[str, int, str], float]
"""``(task_id, rollout, command) -> seconds`` a padded call lasts at least (before ``--time-scale``)."""


def _padded_bash(pad: Pad, scale: float) -> Callable[[str, int], Tool]:
    """A bash tool per rollout that sleeps after each call until ``pad(task_id, rollout, command)`` x ``scale``
    seconds have passed. Keyed by the command, not by call order, so that a call run speculatively (or twice) pads
    the same as when the model asks for it."""
    inner = bash_tool(timeout=120.0)
    handler = inner.handler
    assert handler is not None

    def for_rollout(task_id: str, rollout: int) -> Tool:
        async def run(ws: Any, args: dict[str, Any]) -> Any:
            start = anyio.current_time()
            result = await handler(ws, args)
            want = pad(task_id, rollout, str(args.get("command", ""))) * scale
            await anyio.sleep(max(0.0, want - (anyio.current_time() - start)))
            return result

        return msgspec.structs.replace(inner, handler=run)

    return for_rollout


def _recorded_pads(groups: list[tuple[Task, list[Trajectory]]]) -> Pad:
    """Each command's recorded duration in its rollout (the first recording of a command that repeats)."""
    recorded: dict[tuple[str, int, str], float] = {}
    for task, trajs in groups:
        for t in trajs:
            for s in t.steps:
                if not s.final:
                    key = (task.task_id, t.rollout, str((s.args or {}).get("command", "")))
                    recorded.setdefault(key, s.tool_seconds or 0.0)
    return lambda task_id, rollout, command: recorded.get((task_id, rollout, command), 0.0)


def _held_out_odds(
    path: Path, trajs: list[Trajectory], group_by: str, observations: Path | None = None
) -> dict[str, dict[str, dict[str, float]]]:
    """Per group (its task id as the experiment names it), the odds factors by kind of call fitted on the guesses
    the predictors make on every other *task* of the trace file (the loaded trajectories): measured on these
    traces, no task uses factors fitted on itself (``speculator.KIND_ODDS`` is fitted on the development set).
    ``observations``: what an earlier run of these trajectories printed (``--observations``), given to the
    predictors as the runtime gives it, so that the odds are fitted on what they will see (the trace file holds
    no observations: a predictor that reads them is otherwise fitted blind)."""
    from speculator import held_out_odds
    from speculator._offline import load_groups, load_observations, with_observations

    loaded = {(t.task_id, t.rollout) for t in trajs}
    groups = load_groups(path)
    if observations is not None:
        groups = with_observations(groups, load_observations(observations))[0]
    records = {task: [r for r in rs if (task, r.get("rollout", 0)) in loaded] for task, rs in groups.items()}
    by_task = held_out_odds({task: rs for task, rs in records.items() if rs})
    if group_by == "task":
        return by_task
    return {f"{t.task_id}:{t.rollout}": by_task[t.task_id] for t in trajs if t.task_id in by_task}


def trajectory_groups(trajs: list[Trajectory], group_by: str) -> list[tuple[Task, list[Trajectory]]]:
    """The groups a trajectory file replays as: with ``group_by="task"`` the rollouts of one ``task_id`` form one
    GRPO group (renumbered 0..n-1 in file order: they share one set-up and fork from it), else every trajectory is
    a group of one (its task named ``task_id:rollout``)."""
    if group_by == "task":
        by_task: dict[str, list[Trajectory]] = {}
        for t in trajs:
            by_task.setdefault(t.task_id, []).append(t)
        return [
            (Task(task_id=task_id, prompt=f"Solve {task_id}."),
             [Trajectory(task_id=task_id, rollout=i, steps=t.steps) for i, t in enumerate(ts)])
            for task_id, ts in by_task.items()
        ]  # fmt: skip
    groups = []
    for t in trajs:
        key = f"{t.task_id}:{t.rollout}"
        groups.append((Task(task_id=key, prompt=f"Solve {t.task_id}."), [Trajectory(task_id=key, steps=t.steps)]))
    return groups


def recorded_seconds(t: Trajectory) -> float:
    """A recording's LLM + tool time (its length when replayed at time scale 1, set-up aside)."""
    return sum((s.llm_seconds or 0.0) + (s.tool_seconds or 0.0) for s in t.steps)


def select_groups(
    groups: list[tuple[Task, list[Trajectory]]],
    max_groups: int | None,
    max_rollout_seconds: float | None,
    tasks: list[str] | None = None,
) -> list[tuple[Task, list[Trajectory]]]:
    """The groups of ``tasks`` (all when None) whose longest rollout lasts at most ``max_rollout_seconds``
    (recorded), then the first ``max_groups`` of them."""
    if tasks is not None:
        unknown = sorted(set(tasks) - {task.task_id for task, _ in groups})
        if unknown:
            raise ValueError(f"--tasks: no group for {unknown}")
        groups = [(task, ts) for task, ts in groups if task.task_id in tasks]
    if max_rollout_seconds is not None:
        groups = [(task, ts) for task, ts in groups if max(map(recorded_seconds, ts)) <= max_rollout_seconds]
    return groups[:max_groups] if max_groups is not None else groups


def main(
    args: argparse.Namespace,
    *,
    progress: Callable[[str], None] = print,
    on_result: Callable[[ExperimentResult], object] | None = None,
) -> int:
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if config(c) is None]
    if unknown:
        print(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)} or {ABLATION}NAME[+NAME], "
              f"with a cache +'{UNWEIGHED}', any speculative one +'{AT_TURN_START}' or +'{UNWEIGHED_FORKS}', a "
              f"predicting one +'{WITH_NGRAM}' or +'{STATED_ODDS}'",
              file=sys.stderr)  # fmt: skip
        return 2
    groups: list[tuple[Task, list[Trajectory]]]
    tools_for = None
    odds = None  # the odds by kind of call: KIND_ODDS, but on a trace file fitted per task on its other tasks
    if args.trajectories:
        trajs = load_trajectories(args.trajectories)[: args.limit]
        group_by = args.group_by or ("task" if len({t.task_id for t in trajs}) < len(trajs) else "rollout")
        tasks = [t for t in args.tasks.split(",") if t] if args.tasks else None
        try:
            groups = select_groups(trajectory_groups(trajs, group_by), args.max_groups, args.max_rollout_seconds, tasks)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        workload = {"kind": "trajectory file", "path": str(args.trajectories), "trajectories": len(trajs),
                    "groups": len(groups), "group_by": group_by, "time_scale": args.time_scale,
                    "pad_tools": args.pad_tools, "rollouts": sum(len(ts) for _, ts in groups),
                    "tasks": [task.task_id for task, _ in groups], "max_groups": args.max_groups,
                    "max_rollout_seconds": args.max_rollout_seconds, "selected_tasks": tasks}  # fmt: skip
        if args.pad_tools:
            tools_for = _padded_bash(_recorded_pads(groups), args.time_scale)
        if any(config(c).speculation and not config(c).oracle for c in configs):  # type: ignore[union-attr]
            odds = _held_out_odds(args.trajectories, trajs, group_by, args.odds_observations)
            workload["kind_odds"] = "fitted per task on the guesses on the file's other tasks (held_out_odds)" + (
                f", given what {args.odds_observations} recorded each call printed" if args.odds_observations else ""
            )
    else:
        terminal = args.workload == "terminal"
        if args.quick:
            args.rollouts = args.rollouts or 2
            args.kernel_mib = args.kernel_mib or 16
            args.time_scale = args.time_scale if args.time_scale != 1.0 else 0.02
        rollouts = args.rollouts or (4 if terminal else 8)
        kernel_mib = args.kernel_mib or (64 if terminal else 256)
        llm_median = args.llm_median or (3.3 if terminal else 1.5)
        groups = []
        for g in range(args.groups):
            work = args.work or (0.2 if args.quick else 1.0)
            task = terminal_task(kernel_mib, work=work) if terminal else calc_task(kernel_mib)
            if args.groups > 1:
                fields = {f: getattr(task, f) for f in task.__struct_fields__}
                task = Task(**{**fields, "task_id": f"{task.task_id}{g}"})
            make = terminal_trajectories if terminal else calc_trajectories
            trajs = make(rollouts, seed=args.seed + g, llm_median=llm_median)
            groups.append((task, [Trajectory(task_id=task.task_id, rollout=t.rollout, steps=t.steps) for t in trajs]))
        if terminal and args.pad_tools:
            tools_for = _padded_bash(lambda task_id, rollout, command: padded_seconds(command), args.time_scale)
        workload = {"kind": args.workload, "task": groups[0][0].task_id, "groups": args.groups,
                    "rollouts_per_group": rollouts, "llm_median_s": llm_median,
                    "llm_sigma": 1.0 if terminal else 0.5, "time_scale": args.time_scale,
                    "warm_interpreter_mib": kernel_mib, "tools_padded": bool(terminal and args.pad_tools),
                    "tool_pads_median_s": PADS if terminal and args.pad_tools else None,
                    "cpu_work": (args.work or (0.2 if args.quick else 1.0)) if terminal else None}  # fmt: skip

    stopped: list[int] = []

    async def stop_on_sigterm(scope: anyio.CancelScope) -> None:
        """SIGTERM (``kill``, ``pkill``, ``timeout``) ends Python at once by default, its workspaces left for the
        next start to collect: cancel the run instead, so that every workspace is closed on the way out."""
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for signum in signals:
                print("SIGTERM: stopping, closing every workspace", file=sys.stderr, flush=True)
                stopped.append(signum)
                scope.cancel()
                return

    async def go() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_sigterm, tg.cancel_scope)
            await run()
            tg.cancel_scope.cancel()

    async def run() -> None:
        result = await run_experiment(
            groups,
            configs=configs,
            time_scale=args.time_scale,
            budget=Budget(max_turns=200, wall_seconds=1800),
            workload=workload,
            tools_for=(lambda ctx: [tools_for(ctx.task.task_id, ctx.rollout)]) if tools_for else None,
            repeats=1 if args.quick else args.repeats,
            on_repeat=lambda partial: write_outputs(partial, args.out),
            progress=progress,
            decisions=args.decisions,
            odds=odds,
            observations=args.observations,
        )
        paths = write_outputs(result, args.out)
        print()
        print(markdown_table(result))
        print(f"\nsame tool-call sequences, results and final states in every configuration: "
              f"{result.same_calls_and_results}")  # fmt: skip
        for d in result.differences[:10]:
            print("  differs:", d)
        print("models:", *(f"  {k}: {v}" for k, v in result.models.items()), sep="\n")
        print("written:", *map(str, paths))
        if on_result is not None:
            on_result(result)

    anyio.run(go)
    return 128 + stopped[0] if stopped else 0


__all__ = ["RolloutContext", "add_arguments", "main"]
