"""The latency-hiding experiment: what each mechanism buys against a baseline, measured side by side.

Configurations, all in one run on the same workload:

- ``baseline``: a fresh workspace per rollout, the task's set-up repeated in each, no cache, no speculation;
- ``fork``: the set-up once, then BunshinFork ``n`` ways;
- ``fork+cache``: plus the tool prefix cache shared by the group (a hit on a state-changing call forks the
  cached state instead of re-executing);
- ``fork+cache+spec``: plus speculative tool execution while the model is still generating;
- ``oracle``: ``fork+cache+spec`` whose only predictor is told the rollout's true next call at the start of each
  turn, as each call of a message is decided, and after each speculated call it chains (the calls after it): the
  bound of this runtime's speculation, same runtime and policy.

Speculation launches a turn's first call on the previous turn's last observation (``Speculation.on_observation``);
a speculative configuration's name ending in ``-at-turn-start`` (``fork+cache+spec-at-turn-start``,
``oracle-at-turn-start``) launches it when the turn starts instead: the ablation of that lead time.

With ``repeats`` the configurations run in turn, repeat after repeat (paired: each repeat runs every
configuration once, back to back), and the summary gives each figure's median and spread (min, max) over repeats.
The order is counterbalanced (``run_order``): odd repeats run the list reversed, so that over an even number of
repeats each configuration runs as often before as after any other, and an effect of the order (a warm host after
the configuration before) does not pass for one of a configuration; ``ExperimentResult.orders`` records it.

LLM model: the replay server serves scripted (or recorded) assistant turns with their ``llm_seconds`` times
``time_scale``; tools execute for real in the workspace (optionally padded with ``sleep`` to their recorded duration
times ``time_scale``). Accounting (``bunshin_async._workspace._accounting``): each configuration runs in a cgroup
subtree and snapshot directory of its own (``accounting_scope``); memory is the summed PSS of every process in that
subtree plus its snapshots and the copy-on-write page images its processes map, sampled every 0.1 s (GiB-seconds is its
integral); CPU is the subtree's own counter, exact.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

import anyio
import msgspec

from bunshin_async._exceptions import InvalidValue
from bunshin_async._llm._replay import ReplayServer, build_turns
from bunshin_async._llm._timing import RecordedTiming
from bunshin_async._rollout._rollout import Budget, GroupRollout, RolloutContext, RolloutResult, Task
from bunshin_async._rollout._state import workspace_state
from bunshin_async._rollout._trajectory import Trajectory
from bunshin_async._tools._tools import Tool, bash_tool
from bunshin_async._workspace._accounting import ResourceMonitor, Subtree, accounting_scope
from bunshin_async._workspace._facade import Workspace
from bunshin_async.agent import WorkspaceExecutor, run_agent
from bunshin_async.cache import ForkStateProvider, ToolCache

__all__ = ["CONFIGS", "Config", "ConfigResult", "ExperimentResult", "config", "run_experiment"]


class Config(msgspec.Struct, frozen=True):
    name: str
    fork: bool
    cache: bool
    speculation: bool
    oracle: bool = False
    without: frozenset[str] = frozenset()  # predictors (by name) left out: the ablation's configurations
    weigh_captures: bool = True  # the cache's GiB·s rule for captures (``ToolCache(weigh_captures=...)``)
    on_observation: bool = True  # Speculation.on_observation (False: the ``-at-turn-start`` configurations)
    weigh_forks: bool = True  # the policy's GiB·s rule for forks (False: ``-unweighed-forks``, memory_weight=0)
    ngram: bool = False  # the n-gram predictors (``history``, ``signatures``, bundled table): ``-with-ngram``
    kind_odds: bool = True  # odds by the kind of call (``speculator.KIND_ODDS``; False: ``-stated-odds``)


CONFIGS = {
    c.name: c
    for c in (
        Config("baseline", fork=False, cache=False, speculation=False),
        Config("fork", fork=True, cache=False, speculation=False),
        Config("fork+cache", fork=True, cache=True, speculation=False),
        Config("fork+cache+spec", fork=True, cache=True, speculation=True),
        Config("oracle", fork=True, cache=True, speculation=True, oracle=True),
    )
}


ABLATION = "fork+cache+spec-without-"
UNWEIGHED = "-unweighed"
AT_TURN_START = "-at-turn-start"
UNWEIGHED_FORKS = "-unweighed-forks"
WITH_NGRAM = "-with-ngram"
STATED_ODDS = "-stated-odds"


def config(name: str) -> Config | None:
    """The configuration ``name`` names: one of ``CONFIGS``, or ``fork+cache+spec-without-A+B`` (speculation
    without the predictors named ``A`` and ``B``: an ablation), or either with a cache followed by ``-unweighed``
    (its cache captures every reachable slow write, without weighing the hold in GiB·s), or a speculative one of
    these followed by ``-at-turn-start`` (a turn's first call launched when the turn starts, not on the last
    observation), or a speculative one followed by ``-unweighed-forks`` (its policy launches forks without the GiB·s
    rule, ``CostAwarePolicy(memory_weight=0)``: what that rule costs in latency and saves in GiB·s), or a predicting
    one followed by ``-with-ngram`` (plus the n-gram predictors ``history`` and ``signatures``, left out by default
    since session 19: offline they launched and hid nothing), or a predicting one followed by ``-stated-odds`` (the
    predictors' own odds, without the factors by kind of call, ``speculator.KIND_ODDS``). None for anything else."""
    if name in CONFIGS:
        return CONFIGS[name]
    if name.endswith(STATED_ODDS):
        base = config(name.removesuffix(STATED_ODDS))
        if base is None or not base.speculation or base.oracle:
            return None
        return msgspec.structs.replace(base, name=name, kind_odds=False)
    if name.endswith(WITH_NGRAM):
        base = config(name.removesuffix(WITH_NGRAM))
        if base is None or not base.speculation or base.oracle:
            return None
        return msgspec.structs.replace(base, name=name, ngram=True)
    if name.endswith(UNWEIGHED_FORKS):
        base = config(name.removesuffix(UNWEIGHED_FORKS))
        if base is None or not base.speculation:
            return None
        return msgspec.structs.replace(base, name=name, weigh_forks=False)
    if name.endswith(AT_TURN_START):
        base = config(name[: -len(AT_TURN_START)])
        if base is None or not base.speculation:
            return None
        return msgspec.structs.replace(base, name=name, on_observation=False)
    if name.endswith(UNWEIGHED) and (base := config(name.removesuffix(UNWEIGHED))) is not None and base.cache:
        return msgspec.structs.replace(base, name=name, weigh_captures=False)
    if name.startswith(ABLATION) and len(name) > len(ABLATION):
        without = frozenset(name[len(ABLATION) :].split("+"))
        return Config(name, fork=True, cache=True, speculation=True, without=without)
    return None


class RolloutSummary(msgspec.Struct):
    rollout: int
    status: str
    reason: str | None
    reward: float | None
    wall_seconds: float
    llm_seconds: float
    tool_seconds: float
    calls: list[str]
    call_seconds: list[float]
    results_digest: str  # of every deterministic tool result (exit code and output), in order
    final_state: str = ""  # digest of the workspace the rollout ended in (workspace_state)
    task_id: str = ""
    step_digests: list[str] = msgspec.field(default_factory=list)  # each result's, to name the first that differs


class ConfigResult(msgspec.Struct):
    name: str
    group_latency_s: float  # start of the run to the last rollout of the last group
    rollout_latency_s: dict[str, float]  # median, p90, max over rollouts
    setup_seconds: float | None
    peak_memory_mib: float
    total_memory_gib_s: float
    cpu_seconds: float
    rollouts: list[RolloutSummary]
    sdk_cpu_seconds: float  # this process's CPU during the run: the SDK, its LLM client and the replay server
    memory_timeline: list[tuple[float, float]]  # (t, MiB)
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    final_states: dict[str, str] = msgspec.field(default_factory=dict)  # "task:rollout" -> workspace_state
    #: Per group (task id): seconds from the run's start to the group's last rollout (its straggler).
    group_latencies: dict[str, float] = msgspec.field(default_factory=dict)
    #: Per group (task id): whether it forked its set-up (``GroupRollout.forked``; None: its set-up failed).
    forked: dict[str, bool | None] = msgspec.field(default_factory=dict)


class Spread(msgspec.Struct, frozen=True):
    median: float
    min: float
    max: float


class ConfigSummary(msgspec.Struct):
    """A configuration over the repeats: median (min, max) of each figure; ``spec`` sums speculation's counts."""

    name: str
    group_latency_s: Spread
    peak_memory_mib: Spread
    total_memory_gib_s: Spread
    cpu_seconds: Spread
    sdk_cpu_seconds: Spread
    spec: dict[str, float] = msgspec.field(default_factory=dict)
    #: The mean over groups of each group's latency (its straggler's end): what a GRPO step waits for per group,
    #: less dominated than ``group_latency_s`` by the one longest group.
    mean_group_latency_s: Spread | None = None
    #: Per predictor (``Candidate.source``): its branches' committed, wasted and failed counts, saved seconds and
    #: wasted CPU seconds, summed over the repeats (which predictor's guesses paid).
    by_source: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)


class ExperimentResult(msgspec.Struct):
    date: str
    machine: dict[str, Any]
    workload: dict[str, Any]
    models: dict[str, str]
    configs: list[ConfigResult]  # the first repeat
    vs_baseline: dict[str, dict[str, float]]  # of the medians over repeats
    same_calls_and_results: bool  # in every configuration of every repeat
    repeats: int = 1
    summary: list[ConfigSummary] = msgspec.field(default_factory=list)
    later_repeats: list[list[ConfigResult]] = msgspec.field(default_factory=list)
    #: Where a configuration differs from the first: "config task:rollout: what" (calls, results or final state,
    #: with the first differing line of the state).
    differences: list[str] = msgspec.field(default_factory=list)
    #: Against ``fork+cache`` (when it ran, and the ``oracle``): per configuration, paired per repeat, the latency
    #: gain (1 - config / fork+cache, of the whole run's latency and of the mean group latency; median, min, max
    #: over repeats), the oracle's gain beside it, the share of the oracle's gain captured (median gain over the
    #: oracle's median gain) and the GiB·s ratio to fork+cache (median, min, max over repeats).
    vs_fork_cache: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    #: Steps (``task:rollout#step``) and final states (``task:rollout final state``) whose result differed between
    #: repeats of the *baseline itself* (random keys, clocks): the equivalence check skips them, and says so here.
    #: Found only with ``repeats`` >= 2; with one repeat every difference counts.
    nondeterministic: list[str] = msgspec.field(default_factory=list)
    #: The order the configurations ran in, per repeat (``run_order``); ``configs``, ``later_repeats`` and every
    #: figure keep the order of the configuration list.
    orders: list[list[str]] = msgspec.field(default_factory=list)


class ReplayAgent:
    """The agent loop (``bunshin_async.agent.run_agent``) against the replay server, one trajectory per rollout.

    ``turns_for`` says how many assistant turns a rollout's recording has when it has no final answer (None when
    it has one): the loop stops there, as the recorded agent did, and the rollout is truncated (``max_turns``).

    With a ``cache`` every tool call goes through a session of that group-wide cache (write hits fork the cached
    state); with ``speculation`` (a factory per rollout) the loop speculates while the model generates. Without
    either, a rollout's calls run after each message ends, as a plain agent loop does."""

    def __init__(
        self,
        base_url: str,
        tools_for: Callable[[RolloutContext], Sequence[Tool]],
        model_for: Callable[[RolloutContext], str],
        *,
        cache: ToolCache | None = None,
        speculation: Callable[[RolloutContext], Any] | None = None,
        turns_for: Callable[[RolloutContext], int | None] | None = None,
    ) -> None:
        import openai

        self.client = openai.AsyncOpenAI(base_url=base_url, api_key="replay", max_retries=0, timeout=600)
        self.tools_for = tools_for
        self.model_for = model_for
        self.cache = cache
        self.speculation = speculation
        self.turns_for = turns_for
        self.specs: list[Any] = []  # every rollout's Speculation, for its metrics
        self.group_sizes: dict[str, int] = {}  # task id -> rollouts in its group
        #: Per ``(task_id, rollout)``: the state of the workspace the rollout ended in (``workspace_state``).
        self.final_states: dict[tuple[str, int], str] = {}

    async def run(self, ctx: RolloutContext) -> Trajectory:
        max_turns = ctx.budget.max_turns or 1000
        recorded = self.turns_for(ctx) if self.turns_for is not None else None
        if recorded is not None:  # a recording without a final answer: replay it to its end, then stop (truncated)
            max_turns = min(max_turns, recorded)
        options: dict[str, Any] = {"max_turns": max_turns, "task_id": ctx.task.task_id, "rollout": ctx.rollout}
        if self.speculation is not None:
            options["speculation"] = spec = self.speculation(ctx)
            self.specs.append(spec)
        else:
            options["start_tools_early"] = False
        tools = list(self.tools_for(ctx))
        if self.cache is None:
            # A committed speculative write moves the rollout into a fork: the executor owns it and hands it back.
            executor = WorkspaceExecutor(ctx.ws, tools, own=True)
            try:
                traj = await run_agent(self.client, self.model_for(ctx), ctx.task.prompt, executor, **options)
                await self._record_state(ctx, executor.workspace)
                return traj
            finally:
                ctx.ws = executor.detach()
        # A capture serves siblings only: a group of one rollout never pays for one.
        capture = self.group_sizes.get(ctx.task.task_id, 2) > 1
        async with self.cache.session(ctx.ws, tools, own=True, salt=ctx.task.task_id, capture=capture) as session:
            try:
                traj = await run_agent(self.client, self.model_for(ctx), ctx.task.prompt, session, **options)
                await self._record_state(ctx, session.workspace)
                return traj
            finally:
                ctx.ws = session.detach()

    async def _record_state(self, ctx: RolloutContext, ws: Workspace) -> None:
        self.final_states[(ctx.task.task_id, ctx.rollout)] = await workspace_state(ws)

    async def aclose(self) -> None:
        await self.client.close()


# Parts of tool output that differ between runs of the same deterministic call, and only those: file times in
# `ls -l` listings, the durations test runners print (unittest's `Ran 4 tests in 0.001s`, pytest's `passed in
# 0.02s`), `ls -l`'s block total (a file a fork's restore reopens for writing is copied up from its snapshot
# layer, and overlayfs's origin xattr can take an extra block on ext4) and the addresses in Python's default reprs
# (`<property object at 0x7f...>`: where the allocator put it, randomised per process).
_VOLATILE = [
    (re.compile(r"( at 0x)[0-9a-f]{6,16}>"), r"\1~>"),
    (re.compile(r"^([-dlcbps][-rwxsStT]{9}[.+@]? .*?)[A-Z][a-z]{2} +\d+ +(?:\d\d:\d\d|\d{4})", re.M), r"\1~"),
    (re.compile(r"^(Ran \d+ tests? in )\d+\.\d+s$", re.M), r"\1~"),
    (re.compile(r"( (?:passed|failed|error|errors|skipped)(?:, .*?)? in )\d+\.\d+s\b"), r"\1~"),
    (re.compile(r"^total \d+$", re.M), "total ~"),
    # A directory's size is its filesystem's bookkeeping, not its content: a tmpfs upper dir (Limits.disk) counts the
    # entries made in that dir, so a copy's copied-up directory (holding only what the copy wrote) and its parent's
    # differ; ext4 counts blocks. docs/security.md, "Disk", states the limit. ls pads every line's columns to the
    # widest value, so the padding of an `ls -l` line goes too.
    (re.compile(r"^([-dlcbps][-rwxsStT]{9}[.+@]?) +(\d+) +(\S+) +(\S+) +", re.M), r"\1 \2 \3 \4 "),
    (re.compile(r"^(d[-rwxsStT]{9}[.+@]? \d+ \S+ \S+ )\d+", re.M), r"\1~"),
    # `ps aux` (procps): %CPU, %MEM, VSZ, RSS, START and TIME are the moment's and the process's age, not the call's
    # result (a copy's processes were restored later than its parent's, and have run for another time); so is
    # STAT's first letter when it is R, S, D or I (running or waiting at that moment: `ps aux | grep x`'s own grep,
    # a server between requests, R or S by the load); USER, PID, TTY, the rest of STAT (Z, T, the flags) and COMMAND
    # are still compared. Columns are padded to the widest value, so the padding goes too.
    (
        re.compile(r"^(\S+) +(\d+) +\d+\.\d +\d+\.\d +\d+ +\d+ +(\S+) +[RSDI]?(\S*) +\S+ +\d[\d:-]* (.*)$", re.M),
        r"\1 \2 ~ \3 ~\4 ~ \5",
    ),
]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def scrub(text: str) -> str:
    """``text`` with its provably volatile parts (``_VOLATILE``) replaced by ``~``."""
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def _summary(r: RolloutResult, final_state: str) -> RolloutSummary:
    steps = r.trajectory.steps if r.trajectory else []
    h = hashlib.sha256()
    each = []
    for s in steps:
        line = f"{s.tool}|{s.exit_code}|{scrub(s.observation or '')}\n".encode()
        h.update(line)
        each.append(hashlib.sha256(line).hexdigest()[:8])
    return RolloutSummary(
        task_id=r.task_id,
        step_digests=each,
        rollout=r.rollout,
        status=r.status,
        reason=r.reason,
        reward=r.reward,
        wall_seconds=round(r.wall_seconds, 3),
        llm_seconds=round(r.llm_seconds, 3),
        tool_seconds=round(r.tool_seconds, 3),
        calls=[str((s.args or {}).get("command", s.tool)) for s in steps if s.tool],
        call_seconds=[round(s.tool_seconds or 0.0, 3) for s in steps if s.tool],
        results_digest=h.hexdigest()[:16],
        final_state=final_state,
    )


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"median": 0.0, "p90": 0.0, "max": 0.0}
    s = sorted(xs)
    return {
        "median": round(statistics.median(s), 3),
        "p90": round(s[min(len(s) - 1, round(0.9 * (len(s) - 1)))], 3),
        "max": round(s[-1], 3),
    }


async def run_config(
    config: Config,
    groups: Sequence[tuple[Task, list[Trajectory]]],
    *,
    time_scale: float,
    budget: Budget,
    tools_for: Callable[[RolloutContext], Sequence[Tool]],
    progress: Callable[[str], None] = print,
    decisions: Path | None = None,
    odds: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
    observed: Callable[[Sequence[RolloutResult]], None] | None = None,
) -> ConfigResult:
    """Run every group under ``config`` concurrently and measure it: everything the configuration creates (bases,
    copies, speculative branches, restored cache hits, captures) lives in one subtree of its own
    (``accounting_scope``), whose counters are its memory and CPU. ``decisions``: a file to write the speculation
    policy's every decision to (JSON lines, ``speculator.Decision``); ``odds``: as ``run_experiment``'s;
    ``observed``: given every rollout's result once the run ended (what its calls printed)."""
    with accounting_scope(config.name) as subtree, ExitStack() as stack:
        sink = None
        if decisions is not None and config.speculation:
            from speculator import jsonl_sink

            decisions.parent.mkdir(parents=True, exist_ok=True)
            sink = jsonl_sink(stack.enter_context(decisions.open("wb")))
        return await _run_config_in(config, groups, subtree, time_scale=time_scale, budget=budget,
                                    tools_for=tools_for, progress=progress, decisions=sink, odds=odds,
                                    observed=observed)  # fmt: skip


async def _run_config_in(
    config: Config,
    groups: Sequence[tuple[Task, list[Trajectory]]],
    subtree: Subtree,
    *,
    time_scale: float,
    budget: Budget,
    tools_for: Callable[[RolloutContext], Sequence[Tool]],
    progress: Callable[[str], None],
    decisions: Callable[[Any], None] | None = None,
    odds: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
    observed: Callable[[Sequence[RolloutResult]], None] | None = None,
) -> ConfigResult:
    trajectories = [t for _, ts in groups for t in ts]
    results: list[RolloutResult] = []
    ends: dict[str, float] = {}
    setup: list[float] = []
    forked: dict[str, bool | None] = {}
    caches: list[ToolCache] = []
    unfinished = {t.key: len(turns) for t in trajectories if not (turns := build_turns(t)) or not turns[-1].final}
    async with ReplayServer(
        trajectories, timing=RecordedTiming(ttft=0.05), time_scale=time_scale, separate_finish=True
    ) as server:
        # Capturing a state costs a dump (~0.1-0.5 s here); only writes slower than that are worth serving by fork.
        # A group's rollouts open their sessions together: a capture no sibling can reach any more is released, and
        # one whose hold the siblings' expected hits cannot pay for (GiB·s) is not taken (``weigh_captures``).
        cache = (
            ToolCache(
                provider=ForkStateProvider(),
                capture_min_duration=1.0,
                release_unreachable=True,
                weigh_captures=config.weigh_captures,
            )
            if config.cache
            else None
        )
        if cache is not None:
            caches.append(cache)
        agent = ReplayAgent(
            server.base_url,
            tools_for,
            lambda ctx: f"replay:{ctx.task.task_id}:{ctx.rollout}",
            cache=cache,
            speculation=(
                _oracle_factory(trajectories, config.on_observation, config.weigh_forks, decisions)
                if config.oracle
                else _speculation_factory(
                    config.without,
                    config.on_observation,
                    config.weigh_forks,
                    decisions,
                    ngram=config.ngram,
                    kind_odds=config.kind_odds,
                    odds=odds,
                )  # fmt: skip
            )
            if config.speculation
            else None,
            turns_for=lambda ctx: unfinished.get(f"{ctx.task.task_id}:{ctx.rollout}"),
        )
        agent.group_sizes = {task.task_id: len(ts) for task, ts in groups}
        t0, cpu0 = time.monotonic(), time.process_time()
        try:
            async with ResourceMonitor(interval=0.1, subtree=subtree) as monitor:

                async def one_group(task: Task, n: int) -> None:
                    async with GroupRollout(task, n, agent, budget=budget, fork=config.fork) as group:
                        async for r in group:
                            results.append(r)
                            ends[task.task_id] = round(time.monotonic() - t0, 3)  # the last one is the straggler
                            progress(
                                f"  [{config.name}] {task.task_id}#{r.rollout} {r.status} reward={r.reward} "
                                f"{r.wall_seconds:.1f}s"
                            )
                        if group.setup_seconds is not None:
                            setup.append(group.setup_seconds)
                        forked[task.task_id] = group.forked

                try:
                    async with anyio.create_task_group() as tg:
                        for task, ts in groups:
                            tg.start_soon(one_group, task, len(ts))
                    latency, sdk_cpu = time.monotonic() - t0, time.process_time() - cpu0
                finally:  # the cache's captures are held until it closes: part of what the configuration cost
                    for c in caches:
                        await c.aclose()
        finally:
            await agent.aclose()
    report = monitor.report()
    results.sort(key=lambda r: (r.task_id, r.rollout))
    if observed is not None:
        observed(results)
    extra: dict[str, Any] = {}
    if agent.specs:
        extra["spec"] = _spec_counts(agent.specs)
        extra["by_source"] = _by_source(agent.specs)
    if caches:
        m = caches[0].metrics()
        extra["cache"] = {
            "hits": m.hits,
            "misses": m.misses,
            "saved_seconds": round(m.saved_seconds, 3),
            "restores": m.restores,
            "restore_seconds": round(m.restore_seconds, 3),
            "captures": m.captures,
            "captures_skipped": m.captures_skipped,
            "captures_skipped_cost": m.captures_skipped_cost,
            "snapshots_evicted": m.snapshots_evicted,
            "restore_failures": m.restore_failures,
            "reads_shared": m.reads_shared,  # speculative reads a sibling's speculative run served
            "reads_shared_seconds": round(m.reads_shared_seconds, 3),
        }
    return ConfigResult(
        name=config.name,
        group_latency_s=round(latency, 3),
        rollout_latency_s=_quantiles([r.wall_seconds for r in results]),
        setup_seconds=round(statistics.median(setup), 3) if setup else None,
        peak_memory_mib=round(report.peak_bytes / (1 << 20), 1),
        total_memory_gib_s=round(report.gib_seconds, 3),
        cpu_seconds=round(report.cpu_seconds, 2),
        sdk_cpu_seconds=round(sdk_cpu, 2),
        rollouts=[_summary(r, _digest(agent.final_states.get((r.task_id, r.rollout), ""))) for r in results],
        final_states={f"{t}:{i}": text for (t, i), text in agent.final_states.items()},
        group_latencies=ends,
        forked=forked,
        memory_timeline=[(round(s.t, 2), round((s.pss_bytes + s.extra_bytes) / (1 << 20), 1)) for s in report.samples],
        extra=extra,
    )


def _speculation_factory(
    without: frozenset[str] = frozenset(),
    on_observation: bool = True,
    weigh_forks: bool = True,
    decisions: Callable[[Any], None] | None = None,
    *,
    ngram: bool = False,
    kind_odds: bool = True,
    odds: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
) -> Callable[[RolloutContext], Any]:
    """Per rollout: the default predictors (stream tap, siblings of the same group, cost-aware policy shared by all
    rollouts), but those named in ``without``; ``ngram``: plus the n-gram predictors over the public traces (the
    bundled table; offline on the terminal-benchmark traces they hid nothing and ran 115 s of wrong calls:
    docs/benchmarks/speculation-history.md); ``kind_odds=False``: the predictors' own odds, not corrected by the kind of
    call; ``odds``: per task id, the factors by kind of call (default, and for a task not in it: ``KIND_ODDS``);
    ``weigh_forks=False``: the policy without its GiB·s rule for forks."""
    from speculator import CostAwarePolicy, SiblingTable, default_ngram, default_speculation

    model = default_ngram() if ngram else None
    policy = CostAwarePolicy(memory_weight=1.0 if weigh_forks else 0.0, decisions=decisions)
    tables: dict[str, SiblingTable] = {}

    def make(ctx: RolloutContext) -> Any:
        table = tables.setdefault(ctx.task.task_id, SiblingTable())
        spec = default_speculation(
            group=ctx.task.task_id, table=table, policy=policy, model=model, without=without,
            odds=(odds or {}).get(ctx.task.task_id) if kind_odds else {},
        )  # fmt: skip
        spec.on_observation = on_observation
        return spec

    return make


def _oracle_factory(
    trajectories: Sequence[Trajectory],
    on_observation: bool = True,
    weigh_forks: bool = True,
    decisions: Callable[[Any], None] | None = None,
) -> Callable[[RolloutContext], Any]:
    """Per rollout: a predictor told the rollout's true next call (from its recording), under the same policy,
    runtime and cache veto as ``fork+cache+spec`` (``weigh_forks=False``: without its GiB·s rule for forks)."""
    from bunshin_async.speculation import Speculation
    from speculator import CostAwarePolicy, OraclePredictor

    policy = CostAwarePolicy(memory_weight=1.0 if weigh_forks else 0.0, decisions=decisions)
    calls = {t.key: [(s.tool, s.args or {}) for s in t.steps if not s.final and s.tool] for t in trajectories}

    def make(ctx: RolloutContext) -> Any:
        script = calls.get(f"{ctx.task.task_id}:{ctx.rollout}", [])
        return Speculation(
            predictors=[OraclePredictor(script)], policy=policy, group=ctx.task.task_id, on_observation=on_observation
        )

    return make


def _spec_counts(specs: Sequence[Any]) -> dict[str, float]:
    m = [s.metrics for s in specs]
    out: dict[str, float] = {
        "calls": sum(x.calls for x in m),
        "launched": sum(x.launched for x in m),
        "paused": sum(x.paused for x in m),
        "committed": sum(x.committed for x in m),
        "wasted": sum(x.wasted for x in m),
        "failed": sum(x.failed for x in m),
        "released": sum(x.released for x in m),  # unused branches not kept for the next turn: could not pay
        "saved_seconds": round(sum(x.saved_seconds for x in m), 3),
        "wasted_seconds": round(sum(x.wasted_seconds for x in m), 3),
        "wasted_cpu_seconds": round(sum(x.wasted_cpu_seconds for x in m), 3),
        "fork_seconds": round(sum(x.fork_seconds for x in m), 3),
        "launched_ahead": sum(x.launched_ahead for x in m),
        "ahead_seconds": round(sum(x.ahead_seconds for x in m), 3),
        "handover_seconds": round(sum(x.handover_seconds for x in m), 3),
    }
    out["hit_rate"] = round(out["committed"] / out["calls"], 3) if out["calls"] else 0.0
    out["launch_precision"] = round(out["committed"] / out["launched"], 3) if out["launched"] else 0.0
    # what the launch rule weighed forks with at the end of the run (bytes, running averages: ``ForkMemory``)
    memory = getattr(specs[0].policy, "memory", None) if specs else None
    for name in ("fork_bytes", "rollout_bytes", "copy_extra") if memory is not None else ():
        figure = getattr(memory, name)
        out[f"policy_{name}"], out[f"policy_{name}_n"] = round(figure.value), figure.n
    # what the run's memory allowance earned (its share of the rollouts' byte-seconds) and its forks cost by the
    # rule's terms, settled and in flight (``speculator._allowance.Allowance``), MiB·s
    allowance = getattr(specs[0].policy, "allowance", None) if specs else None
    if allowance is not None:
        out["policy_allowance_mib_s"] = round(allowance.share * allowance.earned / 2**20, 1)
        out["policy_allowance_left_mib_s"] = round(allowance.balance / 2**20, 1)
    for verdict, n in sorted(getattr(specs[0].policy, "verdicts", {}).items()) if specs else ():
        out[f"verdict_{verdict}"] = n  # how many options the policy judged so (``speculator.Verdict``)
    return out


def _by_source(specs: Sequence[Any]) -> dict[str, dict[str, float]]:
    """Per predictor: what its branches did (``BranchRecord``s of every turn)."""
    out: dict[str, dict[str, float]] = {}
    for spec in specs:
        for turn in spec.turns:
            for b in turn.branches:
                acc = out.setdefault(b.source or "?", dict.fromkeys(_SOURCE_FIELDS, 0.0))
                acc["launched"] += 1
                acc[b.outcome] += 1
                acc["saved_seconds"] += b.saved_seconds
                if b.outcome != "committed":
                    acc["wasted_cpu_seconds"] += b.cpu_seconds
    return {k: {f: round(v, 3) for f, v in acc.items()} for k, acc in sorted(out.items())}


_SOURCE_FIELDS = ("launched", "committed", "wasted", "failed", "saved_seconds", "wasted_cpu_seconds")


def _spread(xs: Sequence[float]) -> Spread:
    return Spread(round(statistics.median(xs), 3), round(min(xs), 3), round(max(xs), 3))


def _summaries(runs: list[list[ConfigResult]]) -> list[ConfigSummary]:
    out = []
    for k, first in enumerate(runs[0]):
        cs = [r[k] for r in runs]
        spec: dict[str, float] = {}
        for c in cs:
            for name, v in c.extra.get("spec", {}).items():
                spec[name] = spec.get(name, 0.0) + v
        if spec:
            spec["hit_rate"] = round(spec["committed"] / spec["calls"], 3) if spec["calls"] else 0.0
            spec["launch_precision"] = round(spec["committed"] / spec["launched"], 3) if spec["launched"] else 0.0
        by_source: dict[str, dict[str, float]] = {}
        for c in cs:
            for source, counts in c.extra.get("by_source", {}).items():
                acc = by_source.setdefault(source, {})
                for f, v in counts.items():
                    acc[f] = round(acc.get(f, 0.0) + v, 3)
        means = [statistics.mean(c.group_latencies.values()) for c in cs if c.group_latencies]
        out.append(
            ConfigSummary(
                name=first.name,
                group_latency_s=_spread([c.group_latency_s for c in cs]),
                peak_memory_mib=_spread([c.peak_memory_mib for c in cs]),
                total_memory_gib_s=_spread([c.total_memory_gib_s for c in cs]),
                cpu_seconds=_spread([c.cpu_seconds for c in cs]),
                sdk_cpu_seconds=_spread([c.sdk_cpu_seconds for c in cs]),
                spec=spec,
                mean_group_latency_s=_spread(means) if len(means) == len(cs) else None,
                by_source=by_source,
            )
        )
    return out


def _ratio(new: float, old: float) -> float:
    return round(1 - new / old, 3) if old else 0.0


async def run_experiment(
    groups: Sequence[tuple[Task, list[Trajectory]]],
    *,
    configs: Sequence[str] = tuple(CONFIGS),
    time_scale: float = 1.0,
    budget: Budget | None = None,
    tools_for: Callable[[RolloutContext], Sequence[Tool]] | None = None,
    workload: dict[str, Any] | None = None,
    progress: Callable[[str], None] = print,
    repeats: int = 1,
    on_repeat: Callable[[ExperimentResult], object] | None = None,
    decisions: Path | None = None,
    odds: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
    observations: Path | None = None,
) -> ExperimentResult:
    """Run ``configs`` on ``groups``, ``repeats`` times in turn; ``on_repeat`` gets the result so far after each
    repeat but the last (to write partial outputs of a long run); ``decisions``: a directory to write each
    speculative run's policy decisions to (``<configuration>-<repeat>.jsonl``); ``odds``: per task id, the odds
    factors by kind of call its predictors use (``speculator.held_out_odds``: fitted on the other tasks of the
    traces replayed; a task not in it: ``speculator.KIND_ODDS``); ``observations``: a file to write what every
    call of every run printed to (``observed_calls``: JSON lines, bounded and scrubbed), for the offline replay
    (``scripts/eval_predictors.py --observations``)."""
    budget = budget or Budget(max_turns=100, wall_seconds=1800)
    if tools_for is None:
        default = [bash_tool(timeout=600.0)]
        tools_for = lambda ctx: default  # noqa: E731
    runs: list[list[ConfigResult]] = []
    orders: list[list[str]] = []
    with ExitStack() as stack:
        sink = None
        if observations is not None:
            observations.parent.mkdir(parents=True, exist_ok=True)
            sink = stack.enter_context(observations.open("wb"))
        for rep in range(max(1, repeats)):
            done: dict[str, ConfigResult] = {}
            orders.append(run_order(configs, rep))
            for name in orders[-1]:
                progress(f"configuration {name}" + (f" (repeat {rep + 1} of {repeats})" if repeats > 1 else ""))
                log = decisions / f"{name}-{rep + 1}.jsonl" if decisions is not None else None
                observed = _observed_to(sink, name, rep + 1) if sink is not None else None
                done[name] = await run_config(_config(name), groups, time_scale=time_scale, budget=budget,
                                              tools_for=tools_for, progress=progress, decisions=log,
                                              odds=odds, observed=observed)  # fmt: skip
            runs.append([done[name] for name in configs])  # the list's order: pairs and ratios index it
            if on_repeat is not None and rep + 1 < repeats:
                on_repeat(_result(runs, workload, time_scale, orders))
    return _result(runs, workload, time_scale, orders)


def observed_calls(results: Sequence[RolloutResult], config: str, repeat: int) -> list[Any]:
    """What every call of ``results`` printed (``speculator._offline.ObservedCall``: bounded, then scrubbed as the
    results' digests are), in order per rollout."""
    from speculator._offline import ObservedCall, bounded_output

    out = []
    for r in results:
        calls = [s for s in (r.trajectory.steps if r.trajectory else []) if s.tool and not s.final]
        for i, s in enumerate(calls):
            out.append(
                ObservedCall(
                    config=config,
                    repeat=repeat,
                    task_id=r.task_id,
                    rollout=r.rollout,
                    index=i,
                    tool=s.tool or "",
                    args=s.args or {},
                    exit_code=s.exit_code,
                    output=scrub(bounded_output(s.observation or "")),
                )  # fmt: skip
            )
    return out


def _observed_to(sink: IO[bytes], config: str, repeat: int) -> Callable[[Sequence[RolloutResult]], None]:
    def write(results: Sequence[RolloutResult]) -> None:
        encoder = msgspec.json.Encoder()
        sink.write(b"".join(encoder.encode(o) + b"\n" for o in observed_calls(results, config, repeat)))
        sink.flush()

    return write


def run_order(configs: Sequence[str], rep: int) -> list[str]:
    """The order repeat ``rep`` (from 0) runs ``configs`` in: as listed on even repeats, reversed on odd ones. Over
    an even number of repeats every configuration runs as often just before as just after its neighbours, and as
    often first as last, so an order effect cancels in the paired ratios' medians instead of favouring the
    configurations listed later (fork+cache+spec always ran right after fork+cache before: ~1-3% faster with no
    branch committed, cause unknown)."""
    if len(set(configs)) != len(configs):
        raise InvalidValue(f"configurations listed twice: {list(configs)}", argument="configs")
    return list(configs)[::-1] if rep % 2 else list(configs)


def _config(name: str) -> Config:
    c = config(name)
    if c is None:
        raise InvalidValue(f"unknown configuration {name!r}; choose from {list(CONFIGS)} or {ABLATION}NAME",
                           argument="configs")  # fmt: skip
    return c


def _result(
    runs: list[list[ConfigResult]],
    workload: dict[str, Any] | None,
    time_scale: float,
    orders: list[list[str]] | None = None,
) -> ExperimentResult:
    out = runs[0]
    summary = _summaries(runs)
    base = summary[0]
    vs = {
        c.name: {
            "peak_memory_reduction": _ratio(c.peak_memory_mib.median, base.peak_memory_mib.median),
            "total_memory_reduction": _ratio(c.total_memory_gib_s.median, base.total_memory_gib_s.median),
            "group_latency_reduction": _ratio(c.group_latency_s.median, base.group_latency_s.median),
        }
        for c in summary[1:]
    }
    volatile = _nondeterministic([run[0] for run in runs])
    differences = [d for run in runs for d in _differences([runs[0][0], *run], volatile)]
    return ExperimentResult(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine={
            "cpus": os.cpu_count(),
            "memory_gib": round(_mem_total() / (1 << 30), 1),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },  # fmt: skip
        workload=workload or {},
        models={
            "llm": f"replay server: recorded per-turn llm_seconds x time_scale {time_scale} (first token after "
            "min(0.05 s, llm_seconds); finish_reason one token interval after the last argument fragment); "
            "simulated, not a real model",
            "tools": "executed for real in the workspace (measured)"
            + (
                "; then each call sleeps until its padded duration x time_scale has passed (see the workload)"
                if workload and (workload.get("tools_padded") or workload.get("pad_tools"))
                else ""
            ),
            "memory": "the configuration's own cgroup subtree and snapshot directory (everything it created): "
            "summed PSS of every process in it + its snapshots and the copy-on-write page images its processes "
            "map (beyond what PSS shows) + what its workspaces wrote (their upper dirs; since 2026-12-04), sampled "
            "every 0.1 s from kernel counts (the snapshot directory a tmpfs of its own, not walked, since "
            "2026-12-04 session 18); CPU: the subtree's cpuacct counter (exact)",
        },
        configs=out,
        vs_baseline=vs,
        same_calls_and_results=not differences,
        differences=differences,
        repeats=len(runs),
        summary=summary,
        later_repeats=runs[1:],
        vs_fork_cache=_vs_fork_cache(runs),
        nondeterministic=sorted(volatile),
        orders=orders if orders is not None else [[c.name for c in run] for run in runs],
    )


def _vs_fork_cache(runs: list[list[ConfigResult]]) -> dict[str, dict[str, Any]]:
    """``ExperimentResult.vs_fork_cache``: gains paired per repeat (each repeat's configurations ran back to back)."""
    names = [c.name for c in runs[0]]
    if "fork+cache" not in names:
        return {}
    ref, oracle = names.index("fork+cache"), names.index("oracle") if "oracle" in names else None

    def gains(k: int, figure: Callable[[ConfigResult], float | None]) -> list[float]:
        out = []
        for run in runs:
            base, new = figure(run[ref]), figure(run[k])
            if base and new is not None:
                out.append(1 - new / base)
        return out

    def mean_group(c: ConfigResult) -> float | None:
        return statistics.mean(c.group_latencies.values()) if c.group_latencies else None

    def latency(c: ConfigResult) -> float:
        return c.group_latency_s

    def memory(c: ConfigResult) -> float:
        return c.total_memory_gib_s

    out: dict[str, dict[str, Any]] = {}
    for k, name in enumerate(names):
        if name in ("baseline", "fork", "fork+cache"):
            continue
        entry: dict[str, Any] = {}
        for label, figure in (("latency", latency), ("mean_group_latency", mean_group)):
            mine = gains(k, figure)
            if not mine:
                continue
            entry[f"{label}_gain"] = _spread(mine)
            if oracle is not None:
                theirs = gains(oracle, figure)
                entry[f"oracle_{label}_gain"] = _spread(theirs)
                best = statistics.median(theirs)
                entry[f"{label}_oracle_share"] = round(statistics.median(mine) / best, 3) if best > 0 else None
        ratios = [r[k].total_memory_gib_s / r[ref].total_memory_gib_s for r in runs if r[ref].total_memory_gib_s]
        if ratios:
            entry["gib_s_ratio"] = _spread(ratios)
        out[name] = entry
    return out


def _nondeterministic(baselines: list[ConfigResult]) -> set[str]:
    """What differed between repeats of the first configuration (the baseline) itself: a step's result
    (``task:rollout#step``) or a final state (``task:rollout final state``)."""
    found: set[str] = set()
    first = {(r.task_id, r.rollout): r for r in baselines[0].rollouts}
    for later in baselines[1:]:
        for r in later.rollouts:
            a = first.get((r.task_id, r.rollout))
            if a is None:
                continue
            for i, (x, y) in enumerate(zip(a.step_digests, r.step_digests, strict=False)):
                if x != y:
                    found.add(f"{r.task_id}:{r.rollout}#{i}")
            if a.final_state != r.final_state:
                found.add(f"{r.task_id}:{r.rollout} final state")
    return found


def _differences(configs: list[ConfigResult], volatile: Collection[str] = ()) -> list[str]:
    """Where each of ``configs[1:]`` differs from ``configs[0]``, but in ``volatile`` (``_nondeterministic``)."""
    base = configs[0]
    found: list[str] = []
    for c in configs[1:]:
        for a, b in zip(base.rollouts, c.rollouts, strict=False):
            where = f"{c.name} {a.task_id}#{a.rollout}"
            steps = [
                i
                for i, (x, y) in enumerate(zip(a.step_digests, b.step_digests, strict=False))
                if x != y and f"{a.task_id}:{a.rollout}#{i}" not in volatile
            ]
            if a.calls != b.calls:
                found.append(f"{where}: calls differ")
            elif len(a.step_digests) != len(b.step_digests) or (
                a.results_digest != b.results_digest and (steps or not a.step_digests)
            ):
                found.append(f"{where}: results differ" + (f" from step {steps[0]}" if steps else ""))
            elif a.final_state != b.final_state and f"{a.task_id}:{a.rollout} final state" not in volatile:
                sa = next((v for k, v in base.final_states.items() if _digest(v) == a.final_state), "").splitlines()
                sb = next((v for k, v in c.final_states.items() if _digest(v) == b.final_state), "").splitlines()
                diff = [f"-{x}" for x in sa if x not in sb][:3] + [f"+{x}" for x in sb if x not in sa][:3]
                found.append(f"{where}: final state differs: {' '.join(diff)}"[:600])
        if len(base.rollouts) != len(c.rollouts):
            found.append(f"{c.name}: {len(c.rollouts)} rollouts, {base.name} has {len(base.rollouts)}")
    return found


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def _fmt(x: Spread, digits: int, repeats: int) -> str:
    if repeats <= 1:
        return f"{x.median:.{digits}f}"
    return f"{x.median:.{digits}f} [{x.min:.{digits}f}-{x.max:.{digits}f}]"


def markdown_table(result: ExperimentResult) -> str:
    """The configurations side by side: medians over the repeats with [min-max] when there are several."""
    n = result.repeats
    rows = [
        "| configuration | group latency (s) | peak memory (MiB) | total memory (GiB·s) | CPU (s) | SDK CPU (s) "
        "| vs baseline: peak / total / latency | speculation: committed / launched, hit rate, saved s, wasted CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = result.summary or _summaries([result.configs])
    for c in summary:
        vs = result.vs_baseline.get(c.name)
        rel = (
            " / ".join(
                f"{-100 * vs[k]:+.0f}%"
                for k in ("peak_memory_reduction", "total_memory_reduction", "group_latency_reduction")
            )
            if vs
            else "(baseline)"
        )
        sp = c.spec
        spec = (
            f"{sp['committed']:.0f} / {sp['launched']:.0f}, {100 * sp['hit_rate']:.0f}% of {sp['calls']:.0f} calls, "
            f"{sp['saved_seconds']:.1f}, {sp['wasted_cpu_seconds']:.1f}"
            if sp
            else ""
        )
        rows.append(
            f"| {c.name} | {_fmt(c.group_latency_s, 1, n)} | {_fmt(c.peak_memory_mib, 0, n)} | "
            f"{_fmt(c.total_memory_gib_s, 2, n)} | {_fmt(c.cpu_seconds, 0, n)} | {_fmt(c.sdk_cpu_seconds, 0, n)} | "
            f"{rel} | {spec} |"
        )
    if n > 1:
        rows.append(
            f"\n{n} paired repeats: medians [min-max]; speculation counts summed over the repeats; odd repeats ran "
            "the configurations in reverse order (`orders` in the JSON)."
        )
    if result.vs_fork_cache:
        rows += ["", _vs_fork_cache_table(result)]
    sources = [(c.name, src, v) for c in summary for src, v in c.by_source.items()]
    if sources:
        rows += [
            "",
            "| configuration | predictor | launched | committed | wasted | failed | saved s | wasted CPU s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        rows += [
            f"| {name} | {src} | {v['launched']:.0f} | {v['committed']:.0f} | {v['wasted']:.0f} | {v['failed']:.0f} "
            f"| {v['saved_seconds']:.1f} | {v['wasted_cpu_seconds']:.1f} |"
            for name, src, v in sources
        ]
    if result.nondeterministic:
        rows.append(
            f"\nNot compared (differed between repeats of the baseline itself): {len(result.nondeterministic)} "
            f"results or final states, e.g. {', '.join(result.nondeterministic[:4])}."
        )
    return "\n".join(rows)


def _pct(x: Any) -> str:
    if not isinstance(x, dict):
        return "-"
    return f"{100 * x['median']:+.1f}% [{100 * x['min']:+.1f}..{100 * x['max']:+.1f}]"


def _vs_fork_cache_table(result: ExperimentResult) -> str:
    """The configurations against fork+cache: latency gains, the oracle's beside them, the share captured."""
    rows = [
        "| vs fork+cache | latency gain | oracle's | share of oracle's | mean group latency gain | oracle's "
        "| share of oracle's | GiB·s ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, e in msgspec.to_builtins(result.vs_fork_cache).items():
        share = [
            "-" if (x := e.get(f"{k}_oracle_share")) is None else f"{100 * x:.0f}%"
            for k in ("latency", "mean_group_latency")
        ]
        ratio = e.get("gib_s_ratio")
        memory = "-" if ratio is None else f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]"
        rows.append(
            f"| {name} | {_pct(e.get('latency_gain'))} | {_pct(e.get('oracle_latency_gain'))} "
            f"| {share[0]} | {_pct(e.get('mean_group_latency_gain'))} "
            f"| {_pct(e.get('oracle_mean_group_latency_gain'))} | {share[1]} "
            f"| {memory} |"
        )
    return "\n".join(rows)


def write_outputs(result: ExperimentResult, out_dir: Path) -> list[Path]:
    """experiment.json, experiment.md and two PNG plots (memory over time; latency per rollout)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "experiment.json", out_dir / "experiment.md"]
    paths[0].write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2))
    paths[1].write_text(markdown_table(result) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional; the JSON holds every figure
        return paths
    fig, ax = plt.subplots(figsize=(8, 4))
    for c in result.configs:
        ax.plot([t for t, _ in c.memory_timeline], [m for _, m in c.memory_timeline], label=c.name)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("memory (MiB, PSS + snapshots)")
    ax.set_title("Memory over time per configuration")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(result.configs))
    for k, c in enumerate(result.configs):
        xs = [i + k * width for i in range(len(c.rollouts))]
        ax.bar(xs, [r.wall_seconds for r in c.rollouts], width=width, label=c.name)
    ax.set_xlabel("rollout")
    ax.set_ylabel("latency (s)")
    ax.set_title("Latency per rollout")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "latency.png", dpi=100)
    plt.close(fig)
    return [*paths, out_dir / "memory.png", out_dir / "latency.png"]
