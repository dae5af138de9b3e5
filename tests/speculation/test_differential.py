"""Differential test: seeded scripted rollouts, each run through the product's agent loop ``run_agent`` with
speculation off (the plain loop, which never enters the speculative turn runtime) and on (real replay server over
loopback, the real ``openai`` SDK, real workspaces and forks), must give identical trajectories: every call's
result and the final workspace (files, directories, links, modes and processes)."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest

from bunshin_async import Workspace
from bunshin_async.rollout import Trajectory
from bunshin_async.speculation import BoundedPolicy, Speculation
from bunshin_async.tools import builtin_tools
from speculator import (
    CostAwarePolicy,
    HistoryPredictor,
    NgramModel,
    Rule,
    RulePredictor,
    SiblingPredictor,
    SiblingTable,
)

from .agent_loop import Run, agent_rollout
from .scripted import group

TOOLS = builtin_tools()
GROUPS, PER_GROUP, CONCURRENCY = 50, 4, 8


def _speculation(seed: int, table: SiblingTable, model: NgramModel, traj: Trajectory) -> Speculation:
    rng = random.Random(seed)
    # Some rules right (the rollout's own next calls), some wrong: both paths must agree either way.
    steps = [s for s in traj.steps if s.tool is not None]
    rules = []
    for _ in range(rng.randrange(0, 3)):
        s = rng.choice(steps) if steps else None
        if s is not None and s.tool is not None and s.args is not None:
            rules.append(Rule(after=rng.choice([None, "f", "ls", "cat"]), then_tool=s.tool, then_args=s.args,
                              probability=rng.uniform(0.2, 1.0), expected_seconds=1.0))  # fmt: skip
    rules.append(Rule(at_start=True, then_tool="bash", then_args={"command": "echo wrong > f9; sleep 0.05"},
                      probability=0.5, expected_seconds=1.0))  # fmt: skip
    predictors = [SiblingPredictor(table, confidence=1.0), HistoryPredictor(model), RulePredictor(rules)]
    policy = (
        BoundedPolicy(max_branches=3, max_forks=2)  # launch everything the predictors say
        if rng.random() < 0.5
        else CostAwarePolicy(default_seconds=1.0, fork_weight=0.2, contention=None, loop_load=None, memory_weight=0.0)
    )
    return Speculation(predictors=predictors, policy=policy, group=traj.task_id, early=rng.random() < 0.8)


def _early(seed: int) -> bool:
    return random.Random(f"plain:{seed}").random() < 0.8  # the plain loop with and without starting calls early


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes when other work shares the cores
async def test_speculation_on_and_off_agree_over_200_seeded_rollouts(serve: Any) -> None:
    await _differential(serve, range(GROUPS), minimum=200)


async def test_speculation_on_and_off_agree_quick(serve: Any) -> None:
    """A few groups of the same test, for every test run (the 200-rollout one is marked slow)."""
    await _differential(serve, range(1000, 1004), minimum=16)


async def _differential(serve: Any, seeds: range, minimum: int) -> None:
    groups = {seed: group(seed, PER_GROUP) for seed in seeds}
    trajs = [t for g in groups.values() for t in g]
    assert len(trajs) >= minimum
    model = NgramModel()
    limit = anyio.Semaphore(CONCURRENCY)
    results: dict[str, tuple[Run, Run]] = {}

    async with serve(trajs) as client:

        async def one(traj: Trajectory, table: SiblingTable, seed: int) -> None:
            async with limit:
                model_name = f"replay:{traj.key}"
                spec = _speculation(seed, table, model, traj)
                async with Workspace() as ws:
                    on = await agent_rollout(client, model_name, ws, TOOLS, spec, task_id=traj.task_id)
                async with Workspace() as ws:
                    off = await agent_rollout(client, model_name, ws, TOOLS, None, early=_early(seed))
                results[traj.key] = (off, on)

        async with anyio.create_task_group() as tg:
            for seed, g in groups.items():
                table = SiblingTable()  # one per group: siblings run concurrently and share it
                for i, traj in enumerate(g):
                    tg.start_soon(one, traj, table, seed * 100 + i)

    launched = committed = wasted = 0
    for key, (off, on) in results.items():
        assert on.calls == off.calls, key
        assert on.final_state == off.final_state, key
        assert on.stop_reason == off.stop_reason == "stop", key
        launched += on.metrics.launched
        committed += on.metrics.committed
        wasted += on.metrics.wasted
    assert len(results) == len(trajs)
    # the runs exercised speculation both ways: commits (forks swapped in) and discarded wrong branches
    assert committed > len(trajs) // 4 and wasted > len(trajs) // 4, (launched, committed, wasted)
