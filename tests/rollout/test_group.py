"""GroupRollout on real workspaces with a scripted agent (the LLM-driven agent has its own tests)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from bunshin_async._compat import BaseExceptionGroup
from bunshin_async._host import _paths
from bunshin_async.rollout import (
    Budget,
    ForkRule,
    GroupRollout,
    RolloutContext,
    RolloutResult,
    Step,
    Task,
    Trajectory,
    WorkspaceLimiter,
    accounting_scope,
)
from tests._walks import Walks

TASK = Task(
    task_id="t",
    prompt="make ok.txt say ok",
    files={"setup.sh": b"echo prepared > prepared.txt\n"},
    setup=["sh setup.sh"],
    background=["sleep 1000"],
    reward_command="grep -q ok ok.txt",
)


class ScriptedAgent:
    """Rollout i sleeps ``delays[i]`` (standing in for the LLM), then writes ok.txt (even rollouts get it right)."""

    def __init__(
        self,
        delays: dict[int, float],
        fail: set[int] = frozenset(),  # type: ignore[assignment]
        turns: int = 2,
        gates: dict[int, anyio.Event] | None = None,
    ) -> None:
        self.delays, self.fail, self.turns, self.gates = delays, fail, turns, gates or {}
        self.seen_prepared: dict[int, str] = {}
        self.seen_background: dict[int, bool] = {}

    async def run(self, ctx: RolloutContext) -> Trajectory:
        i = ctx.rollout
        self.seen_prepared[i] = await ctx.ws.read_text("prepared.txt")
        self.seen_background[i] = "sleep 1000" in (await ctx.ws.exec("ps -eo args")).stdout
        steps = []
        for turn in range(self.turns):
            if ctx.budget.max_turns is not None and turn >= ctx.budget.max_turns:
                return Trajectory(task_id=ctx.task.task_id, rollout=i, steps=steps, stop_reason="max_turns")
            await anyio.sleep(self.delays.get(i, 0.0) / self.turns)
            if i in self.fail:  # as a task group inside an agent raises it: the failure's own message one level down
                raise BaseExceptionGroup("unhandled errors in a TaskGroup", [RuntimeError(f"agent {i} broke")])
            cmd = f"echo {'ok' if i % 2 == 0 else 'no'} > ok.txt"
            r = await ctx.ws.exec(cmd)
            steps.append(Step(tool="bash", args={"command": cmd}, exit_code=r.exit_code, tool_seconds=r.duration))
        if i in self.gates:
            await self.gates[i].wait()
        return Trajectory(task_id=ctx.task.task_id, rollout=i, steps=steps, stop_reason="stop")


async def test_group_of_8_yields_in_completion_order_from_one_setup() -> None:
    # Rollout i ends only once rollout i+1's result was yielded (7 ends first): a group yielding in any order but
    # completion order would wait forever.
    gates = {i: anyio.Event() for i in range(7)}
    agent = ScriptedAgent({}, gates=gates)
    results = []
    with anyio.fail_after(120):
        async with GroupRollout(TASK, 8, agent, fork="always") as group:  # a cheap set-up forks only if forced
            async for r in group:
                results.append(r)
                if r.rollout - 1 in gates:
                    gates[r.rollout - 1].set()
    assert [r.rollout for r in results] == list(range(7, -1, -1))
    assert all(r.status == "finished" and r.loss_mask == 1.0 for r in results)
    assert {r.rollout: r.reward for r in results} == {i: 1.0 if i % 2 == 0 else 0.0 for i in range(8)}
    assert all(r.fork_mode.startswith("criu") for r in results) and group.forked is True
    assert agent.seen_prepared == {i: "prepared\n" for i in range(8)}
    assert all(agent.seen_background.values())  # the forked copies kept the set-up's background process


async def test_budgets_truncate_mask_and_free_while_siblings_finish() -> None:
    agent = ScriptedAgent({0: 3600.0, 1: 0.1, 2: 0.1})  # rollout 0 ends only by its 2 s wall-clock budget
    with anyio.fail_after(120):
        async with GroupRollout(TASK, 3, agent, budget=Budget(wall_seconds=2.0), fork=False) as group:
            results = {r.rollout: r async for r in group}
    assert results[0].status == "truncated" and results[0].reason == "wall_clock" and results[0].loss_mask == 0.0
    assert results[0].reward is None
    assert results[1].status == results[2].status == "finished"
    async with GroupRollout(TASK, 2, ScriptedAgent({}, turns=5), budget=Budget(max_turns=1)) as group:
        for r in await group.collect():
            assert (r.status, r.reason, r.loss_mask) == ("truncated", "max_turns", 0.0)
            assert r.trajectory is not None and len(r.trajectory.steps) == 1


async def test_a_failing_agent_does_not_stop_the_group() -> None:
    async with GroupRollout(TASK, 4, ScriptedAgent({}, fail={2})) as group:
        results = {r.rollout: r for r in await group.collect()}
    assert results[2].status == "failed" and results[2].reason == "ExceptionGroup: RuntimeError: agent 2 broke"
    assert results[2].loss_mask == 0.0
    assert [results[i].status for i in (0, 1, 3)] == ["finished"] * 3


async def test_cancelling_the_group_frees_every_workspace() -> None:
    with anyio.move_on_after(3):
        async with GroupRollout(TASK, 4, ScriptedAgent({i: 60.0 for i in range(4)})) as group:
            async for _ in group:
                pytest.fail("nothing should finish")
    # the autouse leak check asserts that nothing is left


async def test_setup_failure_is_reported_per_rollout() -> None:
    bad = Task(task_id="bad", prompt="", setup=["exit 3"])
    async with GroupRollout(bad, 3, ScriptedAgent({})) as group:
        results = await group.collect()
    assert len(results) == 3 and all(r.status == "failed" and "exited 3" in (r.reason or "") for r in results)


@pytest.mark.slow
async def test_four_groups_of_8_under_a_global_limit() -> None:
    limiter = WorkspaceLimiter(12)
    peak = 0

    class Watching(ScriptedAgent):
        async def run(self, ctx: RolloutContext) -> Trajectory:
            nonlocal peak
            live = sum(1 for _ in _paths.workspaces_dir().iterdir())  # every live workspace has a directory
            peak = max(peak, live)
            return await super().run(ctx)

    results = []

    async def group(g: int) -> None:
        task = Task(task_id=f"g{g}", prompt="", setup=["echo prepared > prepared.txt"], reward_command="true")
        async with GroupRollout(task, 8, Watching({i: 0.2 for i in range(8)}), limiter=limiter) as grp:
            results.extend(await grp.collect())

    async with anyio.create_task_group() as tg:
        for g in range(4):
            tg.start_soon(group, g)
    assert len(results) == 32 and all(r.status == "finished" for r in results)
    assert 0 < peak <= 12 + 4  # plus at most one base per group while it forks
    assert limiter.peak <= 12 and limiter.in_use == 0


async def test_a_group_of_one_runs_in_its_set_up_workspace_without_a_snapshot() -> None:
    """Nothing to share: the rollout runs where the set-up ran (no dump, no copy), still set up once."""
    agent = ScriptedAgent({})
    async with GroupRollout(TASK, 1, agent) as group:
        [result] = [r async for r in group]
    assert result.status == "finished" and result.reward == 1.0
    assert result.fork_mode == "fresh" and group.setup_seconds is not None
    assert agent.seen_prepared == {0: "prepared\n"} and agent.seen_background == {0: True}


class HoldersSeen(ScriptedAgent):
    """Records, while each rollout runs (every copy exists by then), who holds what in the run's snapshot store: per
    snapshot directory or layer (``<id>.users/``), the names of its users."""

    def __init__(self, store: Path) -> None:
        super().__init__({})
        self.store = store
        self.copies: set[str] = set()
        self.holders: list[dict[str, set[str]]] = []

    async def run(self, ctx: RolloutContext) -> Trajectory:
        self.copies.add(ctx.ws.id)
        held = {}
        for users in [*self.store.glob("*.users"), *self.store.glob(".layers/*.users")]:
            held[users.name.removesuffix(".users")] = {u.name for u in users.iterdir()}
        self.holders.append(held)
        return await super().run(ctx)


async def test_the_base_snapshot_is_held_only_by_the_copies_once_they_exist() -> None:
    """Nothing of the group holds its base snapshot while the rollouts run: its directory and layer are the copies'
    (a copy-on-write copy maps the page image, every copy mounts the layer), and when the group ends the run's
    snapshot store holds nothing, as the accounting reader sees it."""
    with accounting_scope("base-held") as subtree:
        assert subtree.snapshot_dir is not None
        agent = HoldersSeen(subtree.snapshot_dir)
        with anyio.fail_after(120):
            async with GroupRollout(TASK, 2, agent, fork="always") as group:  # too cheap a set-up to fork unforced
                results = [r async for r in group]
        assert all(r.status == "finished" for r in results) and group.forked is True
        assert len(agent.copies) == 2 and len(agent.holders) == 2
        for held in agent.holders:
            assert held, "the copies hold their base's layer"
            for name, users in held.items():
                assert users <= agent.copies, (name, users)  # no snapshot-<id> user: the group let go of it
        usage = subtree.read()
        assert (usage.snapshot_bytes, usage.image_bytes) == (0, 0)
        assert not [p for p in subtree.snapshot_dir.rglob("*") if not p.is_dir()]


class Workspaces:
    """Records which workspace each rollout runs in."""

    def __init__(self) -> None:
        self.workspaces: dict[int, str] = {}

    async def run(self, ctx: RolloutContext) -> Trajectory:
        self.workspaces[ctx.rollout] = ctx.ws.id
        return Trajectory(task_id=ctx.task.task_id, rollout=ctx.rollout, steps=[], stop_reason="stop")


class SetUpCount:
    """Reads how often the set-up ran in the rollout's workspace (``ran.txt`` gets a line per run), and which
    workspace the rollout runs in."""

    def __init__(self) -> None:
        self.runs: dict[int, str] = {}
        self.workspaces: dict[int, str] = {}

    async def run(self, ctx: RolloutContext) -> Trajectory:
        self.runs[ctx.rollout] = await ctx.ws.read_text("ran.txt")
        self.workspaces[ctx.rollout] = ctx.ws.id
        return Trajectory(task_id=ctx.task.task_id, rollout=ctx.rollout, steps=[], stop_reason="stop")


async def test_a_cheap_set_up_is_not_forked_each_rollout_sets_up_its_own_workspace() -> None:
    """Nothing worth sharing (one echo, no memory): the base runs rollout 0 and the others start fresh, each
    repeating the set-up, on the tokens the group reserved (a limit of exactly n would deadlock otherwise)."""
    cheap = Task(task_id="cheap", prompt="", setup=["echo x >> ran.txt"], reward_command="true")
    agent, limiter = SetUpCount(), WorkspaceLimiter(3)
    # A loaded machine must not make one echo look as slow as a fork: only the memory threshold is the default.
    with anyio.fail_after(120):
        async with GroupRollout(cheap, 3, agent, limiter=limiter, fork_rule=ForkRule(min_setup_seconds=30)) as group:
            results = await group.collect()
    assert group.forked is False
    assert sorted(r.rollout for r in results) == [0, 1, 2]
    assert all(r.status == "finished" and r.reward == 1.0 and r.fork_mode == "fresh" for r in results)
    assert agent.runs == {i: "x\n" for i in range(3)}  # each set itself up, once, in its own workspace
    assert len(set(agent.workspaces.values())) == 3
    assert limiter.in_use == 0 and limiter.peak == 3


async def test_a_task_that_prepares_nothing_runs_every_rollout_fresh() -> None:
    """Nothing to share: no base is set up first, every rollout gets a fresh workspace of its own."""
    bare = Task(task_id="bare", prompt="", reward_command="true")
    agent, limiter = Workspaces(), WorkspaceLimiter(3)
    with anyio.fail_after(120):
        async with GroupRollout(bare, 3, agent, limiter=limiter) as group:
            assert group.forked is False
            results = await group.collect()
    assert all(r.status == "finished" and r.reward == 1.0 and r.fork_mode == "fresh" for r in results)
    assert len(set(agent.workspaces.values())) == 3
    assert limiter.in_use == 0


async def test_a_slow_set_up_is_forked() -> None:
    slow = Task(task_id="slow", prompt="", setup=["echo x >> ran.txt", "sleep 0.6"], reward_command="true")
    agent = SetUpCount()
    rule = ForkRule(min_extra_bytes=1 << 40)  # only the set-up's time can decide
    async with GroupRollout(slow, 3, agent, fork_rule=rule) as group:
        results = await group.collect()
    assert group.forked is True
    assert all(r.status == "finished" and r.fork_mode.startswith("criu") for r in results)
    assert agent.runs == {i: "x\n" for i in range(3)}  # set up once, in the base
    assert len(set(agent.workspaces.values())) == 3


async def _decided_by_memory(task: Task, n: int) -> tuple[bool | None, list[RolloutResult], SetUpCount]:
    """Runs a group of ``n`` whose fork only the memory its set-up left can decide: what it did, its results."""
    agent = SetUpCount()
    async with GroupRollout(task, n, agent, fork_rule=ForkRule(min_setup_seconds=float("inf"))) as group:
        results = await group.collect()
    return group.forked, results, agent


async def test_a_set_up_holding_memory_is_forked() -> None:
    hold = "import time; b = bytes(range(256)) * (32 << 12); open('held', 'w').close(); time.sleep(1e6)"
    heavy = Task(
        task_id="heavy",
        prompt="",
        setup=["echo x >> ran.txt"],
        background=[f'python3 -c "{hold}"'],  # 32 MiB of written pages
        ready=["test -e held"],
        reward_command="true",
    )
    forked, results, agent = await _decided_by_memory(heavy, 2)
    assert forked is True
    assert all(r.status == "finished" and r.fork_mode.startswith("criu") for r in results)
    assert agent.runs == {0: "x\n", 1: "x\n"}


async def test_a_set_up_that_writes_many_files_is_weighed_without_a_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule's two readings of the base (fresh, then set up) take its written bytes from its own disk's count:
    20000 files and 24 MiB written decide the fork by memory, and no tree of any workspace is walked."""
    write = "mkdir many && cd many && seq 20000 | xargs touch && head -c $((24 << 20)) /dev/urandom > data"
    files = Task(task_id="files", prompt="", setup=[write, "echo x >> ran.txt"], reward_command="true")
    walks = Walks().install(monkeypatch)
    forked, results, agent = await _decided_by_memory(files, 2)
    assert forked is True
    assert all(r.status == "finished" and r.fork_mode.startswith("criu") for r in results)
    assert agent.runs == {0: "x\n", 1: "x\n"}
    assert walks.roots == []


@pytest.mark.parametrize(("n", "forked"), [(2, False), (3, True)])
async def test_the_same_set_up_is_forked_for_a_larger_group(n: int, forked: bool) -> None:
    """12 MiB left beyond a fresh workspace: a pair would hold them twice (under the 16 MiB a fork is worth), a group
    of three three times (24 MiB spared): the rule weighs what the fork spares the group."""
    task = Task(task_id="12m", prompt="", setup=["head -c $((12 << 20)) /dev/zero > data", "echo x >> ran.txt"],
                reward_command="true")  # fmt: skip
    decided, results, agent = await _decided_by_memory(task, n)
    assert decided is forked
    assert all(r.status == "finished" for r in results)
    assert agent.runs == dict.fromkeys(range(n), "x\n")
    assert len(set(agent.workspaces.values())) == n
