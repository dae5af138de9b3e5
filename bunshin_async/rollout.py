"""The rollout API for RL trainers: GRPO groups forked from one warm workspace, and the trajectories they record::

    from bunshin_async.rollout import Budget, GroupRollout, Task

    async with GroupRollout(task, 8, agent, budget=Budget(max_turns=30, wall_seconds=600)) as group:
        async for result in group:            # each RolloutResult as it finishes
            train_on(result.trajectory, result.reward, result.loss_mask)

An agent has ``async def run(ctx: RolloutContext) -> Trajectory`` (build it on ``bunshin_async.agent.run_agent``).
Trajectories are JSONL records (``load_trajectories``, ``dump_trajectories``), which ``bunshin_async.llm`` replays.
A run's true memory and CPU (everything it created, by the kernel's counters)::

    with accounting_scope("my-groups") as subtree:
        async with ResourceMonitor(subtree=subtree) as monitor:
            ...                                    # GroupRollouts, caches, speculation
        print(monitor.report().gib_seconds, subtree.read().cpu_seconds)
"""

from __future__ import annotations

from ._public import publish as _publish
from ._rollout._rollout import (
    Budget,
    ForkRule,
    GroupRollout,
    RolloutAgent,
    RolloutContext,
    RolloutResult,
    Task,
    WorkspaceLimiter,
    command_reward,
)
from ._rollout._trajectory import Step, Trajectory, dump_trajectories, iter_trajectories, load_trajectories
from ._workspace._accounting import (
    MemoryReport,
    ResourceMonitor,
    Subtree,
    Usage,
    accounting_scope,
    byte_seconds_net,
)

__all__ = [
    "Budget",
    "ForkRule",
    "MemoryReport",
    "GroupRollout",
    "ResourceMonitor",
    "RolloutAgent",
    "RolloutContext",
    "RolloutResult",
    "Step",
    "Task",
    "Subtree",
    "Trajectory",
    "Usage",
    "WorkspaceLimiter",
    "accounting_scope",
    "byte_seconds_net",
    "command_reward",
    "dump_trajectories",
    "iter_trajectories",
    "load_trajectories",
]

_publish(__name__, globals())
