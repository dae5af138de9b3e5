"""Speculation benchmark: end-to-end rollout latency with speculation off, tap only (calls start when their
arguments are complete), full (tap + siblings + history + cost-aware policy) and the upper bound (a perfect
predictor), side by side in one run, on trajectories shaped like the public traces.

Workload: ``--tasks`` trajectories of ``../shared/traces/swebench-gemini-3-pro.jsonl.gz`` (first ``--steps``
calls each), ``--rollouts`` rollouts per task that share a prefix (geometric, mean ~3.9 calls, as measured on timed
multi-rollout traces) and then diverge. Each call becomes a safe command that takes the call's tool time
(``sleep`` padding; a read-only call stays read-only, ``timeout T tail -f /dev/null``); identical recorded commands
map to identical commands, so repetition survives. Tool time per kind: the medians of the timed traces with
log-normal spread; LLM time per turn: the recorded step period minus the tool time (at least 1 s). Everything is
multiplied by ``--scale``; forks are not (they take their real time), which penalizes speculation at small scales.
Rollouts of a task start ``--stagger`` (scaled) seconds apart, so later siblings can use what earlier ones did.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("BUNSHIN_RUNDIR", "/tmp/spec-bench-ws")

import anyio  # noqa: E402
import openai  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bunshin_async import Workspace  # noqa: E402
from bunshin_async._tools import bash_tool  # noqa: E402
from bunshin_async._trajectory import Step, Trajectory  # noqa: E402
from bunshin_async.llm import RecordedTiming, ReplayServer  # noqa: E402
from bunshin_async.speculation import (  # noqa: E402
    CallKey,
    Candidate,
    PredictionContext,
    Speculation,
    WorkspaceHandle,
)
from speculator import CostAwarePolicy, HistoryPredictor, NgramModel, SiblingPredictor, SiblingTable  # noqa: E402
from speculator.harness import RolloutTrace, replay_rollout  # noqa: E402

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "swebench-gemini-3-pro.jsonl.gz"
TOOL_MEDIAN = {"read": 0.019, "search": 0.05, "edit": 0.05, "fs_mutate": 0.05, "exec": 0.25, "test": 1.2,
               "install": 28.5, "submit": 0.02}  # fmt: skip
READ_KINDS = {"read", "search"}


def _tool_seconds(kind: str, rng: random.Random) -> float:
    return min(60.0, TOOL_MEDIAN.get(kind, 0.25) * rng.lognormvariate(0.0, 1.0))


def _command(step: dict[str, Any], seconds: float, scale: float) -> str:
    h = hashlib.sha1(step["args"]["command"].encode()).hexdigest()[:10]
    t = max(0.001, seconds * scale)
    if step.get("kind") in READ_KINDS and step.get("read_only"):
        return f"timeout {t:.3f} tail -f /dev/null; echo {h}"
    return f"sleep {t:.3f}; echo {h} >> log_{h[:2]}; cat log_{h[:2]} | wc -l"


def load_workload(tasks: int, steps: int, rollouts: int, scale: float, seed: int) -> list[list[Trajectory]]:
    rng = random.Random(seed)
    groups: list[list[Trajectory]] = []
    with gzip.open(TRACES, "rb") as f:
        for line in f:
            rec = json.loads(line)
            calls = [s for s in rec["steps"] if s.get("tool") == "bash" and s.get("kind") not in ("format_error",
                     "submit")][:steps]  # fmt: skip
            if len(calls) < 4:
                continue
            timed = []
            for s in calls:
                tool = _tool_seconds(s.get("kind", "exec"), rng)
                llm = max(1.0, float(s.get("step_period_seconds") or 4) - tool)
                timed.append((s, tool, llm))
            group = []
            for r in range(rollouts):
                if r == 0:
                    mine = timed
                else:
                    keep = min(len(timed), int(rng.expovariate(1 / 3.9)) + 1)  # shared prefix, at least the 1st
                    tail = timed[keep:]
                    rng.shuffle(tail)  # then its own way: the same kinds of calls, another order, some dropped
                    mine = timed[:keep] + tail[: max(0, len(tail) - rng.randrange(0, 3))]
                out = [Step("bash", {"command": _command(s, tool, scale)}, llm_seconds=llm * scale, turn=i,
                            tool_seconds=tool * scale)
                       for i, (s, tool, llm) in enumerate(mine)]  # fmt: skip
                out.append(Step(None, None, llm_seconds=1.0 * scale, assistant_text="done"))
                group.append(Trajectory(task_id=rec["task_id"], rollout=r, steps=out))
            groups.append(group)
            if len(groups) >= tasks:
                break
    return groups


class OraclePredictor:
    """Knows the trajectory: the exact next call, with probability 1 (the upper bound of speculation)."""

    name = "oracle"

    def __init__(self, traj: Trajectory) -> None:
        self.calls = [s for s in traj.steps if s.tool is not None]

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        n = len(ctx.history)
        if n >= len(self.calls):
            return []
        s = self.calls[n]
        assert s.tool is not None
        return [Candidate(name=s.tool, arguments=dict(s.args or {}), probability=1.0, source=self.name,
                          expected_seconds=s.tool_seconds)]  # fmt: skip

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass


async def run_mode(
    mode: str, groups: list[list[Trajectory]], client: openai.AsyncOpenAI, concurrency: int, stagger: float
) -> list[RolloutTrace]:
    tools = [bash_tool()]
    limit = anyio.Semaphore(concurrency)
    policy = CostAwarePolicy(max_forks=2)  # shared across the run: what it learns about latencies carries over
    model = NgramModel()  # learned online from this run's calls
    out: list[RolloutTrace] = []

    def speculation(traj: Trajectory, table: SiblingTable) -> Speculation | None:
        if mode == "off":
            return None
        if mode == "tap":
            return Speculation(predictors=[], early=True)
        if mode == "oracle":
            return Speculation(predictors=[OraclePredictor(traj)], policy=CostAwarePolicy(fork_weight=0.0),
                               early=True)  # fmt: skip
        return Speculation(predictors=[SiblingPredictor(table), HistoryPredictor(model)], policy=policy,
                           group=traj.task_id)  # fmt: skip

    async def one(traj: Trajectory, table: SiblingTable, delay: float) -> None:
        await anyio.sleep(delay)
        async with limit:
            async with Workspace() as ws, WorkspaceHandle(ws, salt=traj.task_id) as handle:
                out.append(await replay_rollout(client, f"replay:{traj.key}", handle, tools,
                                                speculation(traj, table)))  # fmt: skip

    async with anyio.create_task_group() as tg:
        for group in groups:
            table = SiblingTable()
            for i, traj in enumerate(group):
                tg.start_soon(one, traj, table, i * stagger)
    return out


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else math.nan


def report(mode: str, traces: list[RolloutTrace], baseline: dict[str, float] | None, wall: float) -> dict[str, Any]:
    lat = [t.wall_seconds for t in traces]
    m = [t.metrics for t in traces]
    calls = sum(x.calls for x in m)
    committed = sum(x.committed for x in m)
    out: dict[str, Any] = {
        "rollouts": len(traces),
        "calls": calls,
        "rollout_seconds": {
            "median": round(statistics.median(lat), 3),
            "p90": round(_q(lat, 0.9), 3),
            "sum": round(sum(lat), 3),
        },  # fmt: skip
        "llm_seconds": round(sum(x.llm_seconds for x in m), 3),
        "critical_tool_seconds": round(sum(x.tool_seconds for x in m), 3),
        "launched": sum(x.launched for x in m),
        "committed": committed,
        "hit_rate": round(committed / calls, 4) if calls else 0.0,
        "wasted": sum(x.wasted for x in m),
        "failed": sum(x.failed for x in m),
        "wasted_seconds": round(sum(x.wasted_seconds for x in m), 3),
        "wasted_cpu_seconds": round(sum(x.wasted_cpu_seconds for x in m), 3),
        "wasted_fork_mib": round(sum(x.wasted_memory_bytes for x in m) / 2**20, 1),
        "fork_seconds": round(sum(x.fork_seconds for x in m), 3),
        "saved_seconds": round(sum(x.saved_seconds for x in m), 3),
        "wall_seconds": round(wall, 3),
    }
    if baseline is not None:
        out["ratio_to_off"] = {
            "median": round(out["rollout_seconds"]["median"] / baseline["median"], 4),
            "sum": round(out["rollout_seconds"]["sum"] / baseline["sum"], 4),
        }
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.1, help="multiply LLM and tool times (forks are real)")
    ap.add_argument("--stagger", type=float, default=3.0, help="seconds (before scaling) between siblings' starts")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="off,tap,full,oracle")
    args = ap.parse_args()
    groups = load_workload(args.tasks, args.steps, args.rollouts, args.scale, args.seed)
    trajs = [t for g in groups for t in g]
    results: dict[str, Any] = {
        "workload": {"tasks": len(groups), "rollouts": len(trajs), "calls": sum(len(t.steps) - 1 for t in trajs),
                     "scale": args.scale, "stagger_seconds": args.stagger * args.scale,
                     "recorded_llm_seconds": round(sum(s.llm_seconds or 0 for t in trajs for s in t.steps), 3),
                     "recorded_tool_seconds": round(sum(s.tool_seconds or 0 for t in trajs for s in t.steps), 3)},
        "host": {"cpus": os.cpu_count()},
    }  # fmt: skip
    baseline: dict[str, float] | None = None
    async with ReplayServer(trajs, timing=RecordedTiming(ttft=0.05 * args.scale)) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="bench", max_retries=0)
        try:
            for mode in args.modes.split(","):
                t0 = time.monotonic()
                traces = await run_mode(mode, groups, client, args.concurrency, args.stagger * args.scale)
                r = report(mode, traces, baseline, time.monotonic() - t0)
                if mode == "off":
                    baseline = r["rollout_seconds"]
                results[mode] = r
                print(f"# {mode}: {r['rollout_seconds']}", file=sys.stderr, flush=True)
        finally:
            await client.close()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    anyio.run(main)
