"""``bunshin bench``: run the experiment on the bundled workload or on a trajectory file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from .._rollout import Budget, RolloutContext, Task
from .._tools import Tool, bash_tool
from .._trajectory import Trajectory, load_trajectories
from ._bundled import calc_task, calc_trajectories
from ._runner import CONFIGS, markdown_table, run_experiment, write_outputs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, baseline first")
    p.add_argument("-n", "--rollouts", type=int, default=8, help="rollouts per group (bundled workload)")
    p.add_argument("--groups", type=int, default=1, help="concurrent groups (bundled workload)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies recorded LLM (and padded tool) times")
    p.add_argument("--llm-median", type=float, default=1.5, help="median LLM seconds per turn (bundled workload)")
    p.add_argument("--kernel-mib", type=int, default=256, help="memory of the task's warm interpreter (MiB)")
    p.add_argument("--trajectories", type=Path, help="replay this JSONL(.gz) trajectory file instead")
    p.add_argument("--limit", type=int, default=40, help="trajectories taken from --trajectories")
    p.add_argument("--pad-tools", action="store_true", help="pad each tool call to its recorded duration")
    p.add_argument(
        "--group-by", choices=["task", "rollout"], default=None,
        help="--trajectories: 'task' replays the rollouts of one task_id as a GRPO group (one set-up, forked); "
        "'rollout' makes each trajectory its own group (default: 'task' when some task has several rollouts)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results"))


def _padded_bash(recorded: dict[tuple[str, int], list[float]], scale: float) -> Any:
    """A bash tool per rollout that sleeps after each call until its recorded duration x ``scale`` has passed."""
    inner = bash_tool(timeout=120.0)
    handler = inner.handler
    assert handler is not None

    def for_rollout(task_id: str, rollout: int) -> Tool:
        queue = list(recorded.get((task_id, rollout), []))

        async def run(ws: Any, args: dict[str, Any]) -> Any:
            start = anyio.current_time()
            result = await handler(ws, args)
            want = (queue.pop(0) if queue else 0.0) * scale
            await anyio.sleep(max(0.0, want - (anyio.current_time() - start)))
            return result

        return msgspec.structs.replace(inner, handler=run)

    return for_rollout


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


def main(args: argparse.Namespace) -> int:
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}", file=sys.stderr)
        return 2
    groups: list[tuple[Task, list[Trajectory]]]
    tools_for = None
    if args.trajectories:
        trajs = load_trajectories(args.trajectories)[: args.limit]
        group_by = args.group_by or ("task" if len({t.task_id for t in trajs}) < len(trajs) else "rollout")
        groups = trajectory_groups(trajs, group_by)
        workload = {"kind": "trajectory file", "path": str(args.trajectories), "trajectories": len(trajs),
                    "groups": len(groups), "group_by": group_by, "time_scale": args.time_scale,
                    "pad_tools": args.pad_tools}  # fmt: skip
        if args.pad_tools:
            recorded = {(task.task_id, t.rollout): [s.tool_seconds or 0.0 for s in t.steps if not s.final]
                        for task, ts in groups for t in ts}  # fmt: skip
            tools_for = _padded_bash(recorded, args.time_scale)
    else:
        groups = []
        for g in range(args.groups):
            task = calc_task(args.kernel_mib)
            if args.groups > 1:
                task = Task(**{**{f: getattr(task, f) for f in task.__struct_fields__}, "task_id": f"calc{g}"})
            trajs = calc_trajectories(args.rollouts, seed=args.seed + g, llm_median=args.llm_median)
            groups.append((task, [Trajectory(task_id=task.task_id, rollout=t.rollout, steps=t.steps) for t in trajs]))
        workload = {"kind": "bundled", "task": "calc", "groups": args.groups, "rollouts_per_group": args.rollouts,
                    "llm_median_s": args.llm_median, "time_scale": args.time_scale,
                    "warm_interpreter_mib": args.kernel_mib}  # fmt: skip

    async def go() -> None:
        result = await run_experiment(
            groups,
            configs=configs,
            time_scale=args.time_scale,
            budget=Budget(max_turns=200, wall_seconds=1800),
            workload=workload,
            tools_for=(lambda ctx: [tools_for(ctx.task.task_id, ctx.rollout)]) if tools_for else None,
        )
        paths = write_outputs(result, args.out)
        print()
        print(markdown_table(result))
        print(f"\nsame tool-call sequences and results in every configuration: {result.same_calls_and_results}")
        print("models:", *(f"  {k}: {v}" for k, v in result.models.items()), sep="\n")
        print("written:", *map(str, paths))

    anyio.run(go)
    return 0


__all__ = ["RolloutContext", "add_arguments", "main"]
