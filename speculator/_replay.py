"""The runtime's launch decision replayed offline: each turn's predictions go through the runtime's own planning
(``plan_launches``: speculable calls only, one option per call, the prefix cache's veto) and a real
``CostAwarePolicy``, fed what the runtime would feed it (each turn's LLM time, every guess's score, each branch's
release, a fork's seconds and bytes from a byte model, and each run through the runtime's own ``tell_run``: a
main-line run its recorded seconds and CPU, a call the prefix cache serves its restore or its wait for a sibling's
flight, a read in place its run, a fork's call, hit or miss, only ``observe_fork_call``); what it launches is scored
against the recorded next call. It answers "what would the runtime launch on these traces, and which rule refuses
the rest", which the raw predictor scores (``_offline.evaluate``: a fixed threshold) cannot.

Every task of a run starts at time 0 and the run's rollouts share one policy, as in ``bench.experiment`` (a run of
several groups shares its policy; ``replay(..., together=False)`` gives each task a run of its own). Times are the
recorded ones times ``time_scale`` (the experiment pads tools and scales LLM turns alike). A branch is asked for at
its turn's end: a hit hides ``min(tool, LLM - fork seconds)`` (a read in place ``min(tool, LLM)``), a miss ran for
as long (its recorded duration when the group ever ran it, else nothing is known of it and 0 is counted). The
prefix cache serves a state a sibling made, and an identical write a sibling's main line is running (its single
flight: not launched, and fork+cache's rollout waits for that call's end). Each rollout's latency
(``ReplayReport.rollouts``, ``speculator._latency``) counts what hits hid on it and, given ``tap``, what the stream
tap hides (every call starts once its arguments are complete). The events keep their recorded times (what a hit
hides does not move a rollout's later turns). Not replayed: chains (launches after a speculated call), branches
kept across turns, re-planning during a turn, and the CPU the machine's load takes (``contention`` is a constant).
"""

from __future__ import annotations

import heapq
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from math import inf

import msgspec

from bunshin_async.speculation import (
    CallKey,
    Classified,
    Launch,
    PredictionContext,
    Predictor,
    Ran,
    chain_root,
    extend_chain,
    plan_launches,
    proposals,
    scores,
    tell_run,
)
from bunshin_async.tools import Effect, bash_tool

from ._latency import RolloutTime
from ._offline import Record, _calls, _context, _outputs
from ._policy import CostAwarePolicy
from ._signature import key_signature

__all__ = ["REASONS", "ByteModel", "Refusal", "ReplayReport", "explain", "replay"]

_MIB = 1 << 20
_INSTALL = re.compile(r"(pip[\d.]*|npm|apt-get|apt|conda|uv|yarn|pnpm|gem|cargo)( |$)")
_BASH = bash_tool()

#: Why an offered call was not launched, in the order the runtime decides: not speculable (an external or
#: nondeterministic call), served by the prefix cache (its veto), odds under the policy's floor (or too deep),
#: no latency gain (``saving`` <= 0), the turn's branch budget, the rollout's fork budget (count or memory), the
#: GiB·s rule (``memory_net`` < 0), the group's forks in flight; ``unexplained``: the policy refused it for a reason
#: this replay of its rule does not know (the policy changed: update ``explain``).
REASONS = (
    "unspeculable",
    "cached",
    "odds",
    "latency",
    "branches",
    "fork budget",
    "GiB·s",
    "group forks",
    "unexplained",
)


def _installs(key: CallKey) -> bool:
    program = key_signature(key).partition(":")[2]
    return bool(_INSTALL.match(program)) or program.startswith("python -m pip")


class ByteModel(msgspec.Struct, frozen=True, kw_only=True):
    """What the policy is told of forks and rollouts (measured by the runtime, given here): a fork's bytes beside
    its rollout, a rollout's, what a committed copy holds more than its rollout (negative: less), a fork's
    seconds, the CPU share of a call on the main line (the experiment's padded calls mostly sleep) and the CPUs'
    contention (0: the policy's floor, ``min_contention``, applies). ``learned``: as in the runtime, the policy
    starts from its priors and is told the bytes only once it launched a fork (a fork is measured when it is
    made); otherwise it knows them from the start. ``restore_seconds``: what a write the tool cache serves takes on
    the main line, its snapshot's restore (the cache benchmark's write hits: 0.11-0.18 s median, loaded), which the
    runtime tells the policy as the call's run time (a read it serves: 0 s). Defaults: session 17's run B, the end
    of the run (``spec.policy_*``).

    The memory terms the runtime measures per fork (session 19), modelled: ``making_mib``, what a fork's making
    holds beyond the fork (``observe_transient``: CRIU's restore, 2.1-2.7 MiB by the ledger); what a call raises
    its fork's cgroup by (``observe_fork_call``, and a miss's bytes, ``observe_miss``), by program
    (``call_mib``): an install (``pip``, ``npm``, ``apt-get``, ...) ``install_mib`` (pip: 37-44 MiB by the
    ledger), an interpreter (``python``, ``node``) ``interpreter_mib`` (the long-tool groups' Python scripts: 3.1
    MiB by session 20's decision logs), anything else 0 (a call that stays under
    the restore's peak is measured 0, ``call_peak``). A call in a fork runs its recorded time; a miss is cut at
    the ask (its seconds then unknown). What it holds over time (``CallMeter``'s byte-seconds): its bytes for at
    most ``install_seconds`` of an install's run (the experiment pads a call with a sleep after it: by session
    19's ledger a padded ``pip install`` held its 37-44 MiB 0.3-0.7 s on the main line and 2.5-3.2 s in forks
    launched together; the longest is taken), for the whole run of anything else."""

    fork_mib: float = 0.23
    rollout_mib: float = 0.57
    copy_extra_mib: float = -0.33
    fork_seconds: float = 0.2
    restore_seconds: float = 0.13
    cpu_share: float = 0.1
    contention: float = 0.0
    learned: bool = False
    making_mib: float = 2.4
    install_mib: float = 40.0
    interpreter_mib: float = 3.0
    install_seconds: float = 3.2
    memory_share: float | None = None  # the policy's ``memory_share`` (None: its default)

    def call_mib(self, key: CallKey) -> float:
        """What a call like ``key`` raises its fork's cgroup by, MiB (the model above)."""
        if _installs(key):
            return self.install_mib
        if key_signature(key).partition(":")[2].startswith(("python", "node")):
            return self.interpreter_mib
        return 0.0

    def call_byte_seconds(self, key: CallKey, seconds: float) -> float:
        """What a call like ``key`` holds above its fork's charge in its first ``seconds`` seconds, byte-seconds."""
        mib = self.call_mib(key)
        held = min(seconds, self.install_seconds) if _installs(key) else seconds
        return mib * _MIB * max(0.0, held)

    def policy(self, clock: Callable[[], float]) -> CostAwarePolicy:
        """A ``CostAwarePolicy`` as the experiment makes it, its machine readings replaced by this model."""
        p = CostAwarePolicy(contention=lambda: self.contention, loop_load=None, clock=clock)
        if self.memory_share is not None:
            p.allowance.share = self.memory_share
        if not self.learned:
            self.told(p)
        return p

    def told(self, p: CostAwarePolicy) -> None:
        """What the runtime tells the policy when a fork is ready (its seconds and bytes, its rollout's, the copy's
        difference to its rollout), and once a fork's call ended (this model has no call's memory: a call that held
        nothing, so the rule charges no call beyond the main line, as before session 19)."""
        p.observe_fork_call(CallKey.of(_BASH, {"command": "true"}), 0.0, 0, 0.0)
        p.observe_transient(round(self.making_mib * _MIB))
        p.observe_fork(self.fork_seconds, round(self.fork_mib * _MIB))
        p.observe_rollout_memory(round(self.rollout_mib * _MIB))
        p.observe_copy(round((self.rollout_mib + self.copy_extra_mib) * _MIB), round(self.rollout_mib * _MIB))


class Refusal(msgspec.Struct, frozen=True):
    """An offered guess that was the next call and was not launched: why, and what the policy weighed
    (``probability`` calibrated, ``expected`` run seconds, ``saving`` and ``memory_net`` in its units; None where
    the policy was not asked)."""

    task: str
    rollout: int
    index: int
    source: str
    reason: str
    command: str
    llm: float
    tool: float
    probability: float | None = None
    expected: float | None = None
    saving: float | None = None
    memory_net: float | None = None


class ReplayReport(msgspec.Struct):
    """Per task, then per source (the predictor whose candidate an option carried; ``all``: every source):
    ``offered`` options, ``launched`` (``forks`` of them in forks), ``hits``, ``hidden`` seconds, ``wrong``
    seconds (what the misses ran until the ask), ``held`` and ``freed`` MiB·s (the forks' bytes for their hold;
    the rollout's bytes for the seconds a hit hid) and one count per refusal reason (``REASONS``).
    ``hideable``: per task, the oracle's bound (``min(tool, LLM)`` of each call the prefix cache does not serve).
    ``rollouts``: per task, each rollout's seconds and what was hidden on it (``speculator._latency``: the group's
    latency is its slowest rollout's)."""

    hideable: dict[str, float] = msgspec.field(default_factory=dict)
    calls: dict[str, int] = msgspec.field(default_factory=dict)
    by_task: dict[str, dict[str, dict[str, float]]] = msgspec.field(default_factory=dict)
    refused: list[Refusal] = msgspec.field(default_factory=list)
    rollouts: dict[str, list[RolloutTime]] = msgspec.field(default_factory=dict)
    spent: float = 0.0  # MiB·s the policy's settled forks cost by its terms (``Allowance.spent``), every run's
    earned: float = 0.0  # MiB·s the main lines held by the policy's estimate (``Allowance.earned``), every run's

    def total(self, source: str = "all", tasks: Iterable[str] | None = None) -> dict[str, float]:
        """``source``'s counts summed over ``tasks`` (all by default)."""
        out: defaultdict[str, float] = defaultdict(float)
        for task in self.by_task if tasks is None else tasks:
            for k, v in self.by_task.get(task, {}).get(source, {}).items():
                out[k] += v
        return dict(out)

    def sources(self) -> list[str]:
        return sorted({s for by in self.by_task.values() for s in by if s != "all"})


def explain(
    policy: CostAwarePolicy, options: Sequence[Launch], selected: Sequence[Launch], *, running: int, forks: int
) -> list[str]:
    """Why each of ``options`` was or was not among ``selected`` (what ``policy.select(options, running=...,
    forks=...)`` just returned): ``"launched"`` or the first rule of ``select`` that refused it (``REASONS``), by
    going through ``select``'s steps again with the policy's public state as ``select`` left it."""
    chosen = {id(o) for o in selected}
    out = dict.fromkeys(range(len(options)), "odds")
    ranked = sorted(
        (
            (policy.saving(o), n, o)
            for n, o in enumerate(options)
            if policy.probability(o) >= policy.min_probability and o.depth <= policy.max_depth
        ),
        key=lambda x: -x[0],
    )
    live = policy.live.total() - sum(1 for o in selected if o.needs_fork)
    stop = ""
    for gain, n, o in ranked:
        if not stop and gain <= 0:
            stop = "latency"
        elif not stop and running >= policy.max_branches:
            stop = "branches"
        if stop:
            out[n] = stop
            continue
        if o.needs_fork:
            if forks >= policy.max_forks or (forks + 1) * policy.fork_bytes.value > policy.memory_budget:
                out[n] = "fork budget"
                continue
            if policy.memory_weight and not policy.weighs_measured:
                if live or policy.expected_seconds(o) > policy.hideable(o):  # measuring: one short call at a time
                    out[n] = "GiB·s"
                    continue
            elif not policy.memory_allows(o):
                out[n] = "GiB·s"
                continue
            limit = policy.group_forks - (0 if policy.lag(o.rollout) >= 1.0 else policy.straggler_reserve)
            if live >= limit:
                out[n] = "group forks"
                continue
            forks, live = forks + 1, live + 1
        running += 1
        out[n] = "launched"
    return [
        r if (r == "launched") == (id(o) in chosen) else ("launched" if id(o) in chosen else "unexplained")
        for r, o in zip(out.values(), options, strict=True)
    ]


def _refusal(
    policy: CostAwarePolicy, task: str, r: int, i: int, source: str, reason: str, key: CallKey, o: Launch | None,
    llm: float, tool: float,
) -> Refusal:  # fmt: skip
    command = str(key.arguments().get("command", ""))[:80]
    if o is None:
        return Refusal(task, r, i, source, reason, command, llm, tool)
    net = policy.memory_net(o) / _MIB if o.needs_fork else None
    return Refusal(task, r, i, source, reason, command, llm, tool, policy.probability(o), policy.expected_seconds(o),
                   policy.saving(o), net)  # fmt: skip


def _told(call: int, held: float) -> Callable[[], tuple[int, float]]:
    """What a fork's call raised its cgroup by and held (``ByteModel``), as ``tell_run`` asks for it."""
    return lambda: (call, held)


def _keys_in(keys: set[CallKey]) -> Callable[[Launch], bool]:
    """A veto of the launches of ``keys`` (those the prefix cache would serve)."""
    return lambda o: o.key in keys


class _Turn(msgspec.Struct):
    ctx: PredictionContext
    proposed: dict[str, dict[CallKey, float]]
    launches: list[Launch]
    start: float = 0.0


def _classify(predictors: Sequence[Predictor], ctx: PredictionContext) -> list[Classified]:
    """What ``predictors`` guess at ``ctx``, classified by the bash tool as the runtime's planner does."""
    out = []
    for p in predictors:
        for cand in p.predict(ctx):
            ck = CallKey(cand.name, _BASH.version, msgspec.json.encode(cand.arguments, order="deterministic"))
            cls = _BASH.classify_call(cand.arguments) if cand.name == _BASH.name else None
            if cls is None:
                out.append(Classified(cand, None, Effect.EXTERNAL, False))
            else:
                out.append(Classified(cand, ck, cls.effect, cls.deterministic))
    return out


def _vetoed(
    predictions: Sequence[Classified], chain: bytes, made: Mapping[bytes, float], flights: Mapping[bytes, float],
    now: float,
) -> set[CallKey]:  # fmt: skip
    """The speculable guesses the prefix cache serves now: a state made, or a write in flight on a main line."""
    return {
        p.key
        for p in predictions
        if p.key is not None
        and p.speculable
        and (
            made.get(state := extend_chain(chain, p.key), inf) <= now
            or (p.effect is Effect.WRITE and flights.get(state, -inf) > now)
        )
    }


def replay(
    groups: Mapping[str, Sequence[Record]],
    make: Callable[[str], Callable[[], Sequence[Predictor]]],
    *,
    model: ByteModel | None = None,
    time_scale: float = 1.0,
    together: bool = True,
    capture_seconds: float = 1.0,
    tap: Callable[[CallKey, float], float] | None = None,
    reask: bool = False,
) -> ReplayReport:
    """Replay ``groups`` (task -> its rollouts' records) through the runtime's planning and a ``CostAwarePolicy``
    (``model`` says what it is told of forks); ``make(task)`` gives a factory of one rollout's predictors, as for
    ``_offline.evaluate``. ``together``: every task in one run sharing one policy (else a run, and a policy,
    per task). The prefix cache serves a state once the call that made it has ended (a write only if it took at
    least ``capture_seconds``, the experiment's ``capture_min_duration``): a sibling's call still running is not
    served, and a guess of it is launched if the policy agrees. ``tap(call, LLM seconds)``: how long before its
    message's end the stream tap starts ``call`` (recorded seconds, x ``time_scale``; the message ends that much
    after its last token), for each rollout's latency (``ReplayReport.rollouts``); None: 0. ``reask``: whenever a
    rollout decides a call, its siblings still in their turn ask their predictors again and launch what the
    policy picks of the new options, but not the sibling's call from the state it was decided in (the cache's:
    ``Launcher.sibling``); counted as ``replanned`` launches, a hit hiding only what is left of the turn."""
    report = ReplayReport()
    runs = [dict(groups)] if together else [{t: rs} for t, rs in groups.items()]
    for run in runs:
        _run(run, make, model or ByteModel(), time_scale, capture_seconds, report, tap or (lambda _k, _s: 0.0), reask)
    return report


def _tail(record: Record) -> float:
    """The LLM seconds of a record's turns after its last call (its answer; format errors are not replayed)."""
    steps = record.get("steps", ())
    n = next((i for i, s in enumerate(steps) if not s.get("tool") or s["tool"] == "submit"), len(steps))
    return sum(float(s.get("llm_seconds") or 0.0) for s in steps[n:] if s.get("kind") != "format_error")


def _run(
    groups: Mapping[str, Sequence[Record]],
    make: Callable[[str], Callable[[], Sequence[Predictor]]],
    model: ByteModel,
    scale: float,
    capture_seconds: float,
    report: ReplayReport,
    tap: Callable[[CallKey, float], float],
    reask: bool = False,
) -> None:
    now = 0.0
    policy = model.policy(lambda: now)
    told = not model.learned
    tasks = list(groups)
    rollouts = {(t, r): _calls(rec) for t in tasks for r, rec in enumerate(groups[t])}
    outputs = {(t, r): _outputs(rec) for t in tasks for r, rec in enumerate(groups[t])}
    gaps = {k: [tap(key, llm) * scale for key, llm, _ in v] for k, v in rollouts.items()}
    rollouts = {k: [(key, llm * scale, tool * scale) for key, llm, tool in v] for k, v in rollouts.items()}
    # per rollout: seconds as fork+cache runs it (its answer's turn, each turn to its message's end), hits' hidden
    # seconds, and those with the tap's
    times = {k: [scale * _tail(groups[k[0]][k[1]]) + sum(gaps[k]), 0.0, 0.0] for k in rollouts}
    durations: dict[str, dict[CallKey, float]] = {t: {} for t in tasks}
    for (t, _), calls in rollouts.items():
        for key, _, tool in calls:
            durations[t].setdefault(key, tool)
    factories = {t: make(t) for t in tasks}
    mine = {k: factories[k[0]]() for k in rollouts}
    chains = {k: [chain_root(k[0])] for k in rollouts}
    # per task, the states (chain keys after a call) the prefix cache can serve, from when: once the first call that
    # made one has ended, a write only if it took at least the cache's ``capture_seconds`` (the experiment's cache
    # captures no faster write; a read's result is recorded whatever it took)
    made: dict[str, dict[bytes, float]] = {t: {} for t in tasks}
    # per task, the writes on a main line until they end: the cache's single flight serves an identical write (the
    # runtime's skip vetoes its launch, ``ToolCache.would_hit``; fork+cache's rollout waits for it)
    flights: dict[str, dict[bytes, float]] = {t: {} for t in tasks}
    stats: dict[str, dict[str, Counter[str]]] = {t: defaultdict(Counter) for t in tasks}
    sums: dict[str, defaultdict[str, defaultdict[str, float]]] = {
        t: defaultdict(lambda: defaultdict(float)) for t in tasks
    }
    # (time, order, kind, task, rollout, index): kind 0 = the turn starts, 1 = the call is decided, 2 = it ended
    events: list[tuple[float, int, int, str, int, int]] = []
    n = 0
    for (task, r), calls in rollouts.items():
        at = 0.0
        for i, (_, llm, tool) in enumerate(calls):
            events += [(at, n, 0, task, r, i), (at + llm, n + 1, 1, task, r, i)]
            n += 2
            at += llm + tool
        events.append((at, n, 2, task, r, len(calls)))
        n += 1
    heapq.heapify(events)
    open_turns: dict[tuple[str, int, int], _Turn] = {}
    # per rollout, what the end of its decided call tells the policy (``tell_run``: where it ran, its seconds, its
    # CPU seconds), told at that end; a fork's hit is told when its branch settles, as a miss is
    ends: dict[tuple[str, int], tuple[Ran, float, float]] = {}
    for task in tasks:
        report.hideable.setdefault(task, 0.0)
        report.calls.setdefault(task, 0)

    while events:
        now, _, kind, task, r, i = heapq.heappop(events)
        calls, name = rollouts[task, r], f"{task}:{r}"
        if i and (end := ends.pop((task, r), None)) is not None:  # the previous call ended: as the runtime tells it
            tell_run(policy, calls[i - 1][0], end[1], end[0], cpu_seconds=end[2])
        if kind == 2:
            policy.rollout_done(name)
            continue
        key, llm, tool = calls[i]
        ctx = _context(task, calls, chains[task, r], i, outputs[task, r])
        if kind == 0:
            predictions = _classify(mine[task, r], ctx)
            best: dict[CallKey, tuple[float, str]] = {}
            for pr in predictions:
                if pr.key is not None and pr.candidate.probability > best.get(pr.key, (-1.0, ""))[0]:
                    best[pr.key] = (pr.candidate.probability, pr.candidate.source)
            speculable = {p.key for p in predictions if p.key is not None and p.speculable}
            vetoed = _vetoed(predictions, ctx.chain, made[task], flights[task], now)
            why = {
                k: "unspeculable" if k not in speculable else "cached"
                for k in best
                if k not in speculable or k in vetoed
            }
            options = plan_launches(
                predictions, veto=_keys_in(vetoed), rollout=name, progress=i, group=task
            )  # fmt: skip
            selected = policy.select(options, running=0, forks=0)
            why.update(
                zip((o.key for o in options), explain(policy, options, selected, running=0, forks=0), strict=True)
            )
            for k, reason in why.items():
                source = best[k][1]
                for src in (source, "all"):
                    c = stats[task][src]
                    c["offered"] += 1
                    if reason != "launched":  # a launch is counted when its branch is settled
                        c[reason] += 1
                    if k == key:
                        c["right offered"] += 1
                        c[f"right {reason}"] += 1
                        sums[task][src][f"right {reason} s"] += min(llm, tool)
                if k == key and reason != "launched":
                    o = next((o for o in options if o.key == k), None)
                    report.refused.append(_refusal(policy, task, r, i, source, reason, k, o, llm, tool))
            if any(o.needs_fork for o in selected):
                if not told:
                    model.told(policy)
                    told = True
                for _ in (o for o in selected if o.needs_fork):
                    policy.observe_fork(model.fork_seconds, round(model.fork_mib * _MIB))
            open_turns[task, r, i] = _Turn(ctx, proposals(predictions), list(selected), now)
            continue
        # the call is decided: score the guesses, settle the launches, let the predictors learn
        turn = open_turns.pop((task, r, i))
        policy.observe_llm(llm)
        for source, probability, hit in scores(turn.proposed, (key,)):
            policy.observe_prediction(source, probability, hit)
        after = extend_chain(chains[task, r][i], key)
        chains[task, r].append(after)
        cached = made[task].get(after, inf) <= now
        write = _BASH.classify_call(key.arguments()).effect is Effect.WRITE
        # a sibling's identical write in flight, and no branch of this call: fork+cache waits for that one's end
        wait = flights[task].get(after, -inf) - now if write and not cached else -inf
        branch = next((o for o in turn.launches if o.key == key), None)
        if wait >= 0 and branch is None:
            cached, tool = True, wait
        if branch is not None:  # the branch's run: in place its whole run (a fork's is told as it settles, below)
            if not branch.needs_fork:
                ends[task, r] = (Ran.IN_PLACE, tool, -1.0)
        elif cached:  # the cache's restore of a write (after its wait for a flight), a read's stored result
            ends[task, r] = (Ran.MAIN, max(0.0, wait) + (model.restore_seconds if write else 0.0), -1.0)
        else:
            ends[task, r] = (Ran.MAIN, tool, model.cpu_share * tool)
        if not cached and (tool >= capture_seconds or not write):
            made[task][after] = min(made[task].get(after, inf), now + tool)
        if not cached and write:
            flights[task][after] = min(flights[task].get(after, inf), now + tool)
        report.calls[task] += 1
        report.hideable[task] += 0.0 if cached else min(llm, tool)
        won = 0.0  # what a hit on this call hid before the ask
        for o in turn.launches:
            # the main line claims the branch of its call, whether or not the cache could now serve the call
            # (a sibling made it during the turn): used, but it hid nothing the cache would not have
            used = o.key == key
            lead = llm - o.turn_elapsed - (model.fork_seconds if o.needs_fork else 0.0)
            ran = min(tool if used else durations[task].get(o.key, 0.0), max(0.0, lead))
            ran = 0.0 if used and cached else ran
            if o.needs_fork:  # what the runtime measures of it when it settles (``ByteModel``)
                call = round(model.call_mib(o.key) * _MIB)
                whole = tool if used else durations[task].get(o.key, inf)
                ended = used or whole <= lead
                held = model.call_byte_seconds(o.key, whole if ended else max(0.0, lead))
                tell_run(policy, o.key, whole if ended else -1.0, Ran.FORK, memory=_told(call, held))
                if not used:
                    policy.observe_miss(round(model.fork_mib * _MIB) + call)
            elif not used and (whole := durations[task].get(o.key, inf)) <= lead:  # a miss in place that ended
                tell_run(policy, o.key, whole, Ran.IN_PLACE)
            policy.release(o, used)
            hold = model.fork_seconds + llm - o.turn_elapsed if o.needs_fork else 0.0
            for src in (o.candidate.source, "all"):
                c, m = stats[task][src], sums[task][src]
                c["launched"] += 1
                c["forks"] += o.needs_fork
                c["hits"] += used
                m["hidden" if used else "wrong"] += ran
                m["held"] += model.fork_mib * hold
                m["freed"] += model.rollout_mib * ran if used and o.needs_fork else 0.0
            won = max(won, ran if used else 0.0)
        if not cached:
            acc = times[task, r]
            acc[0] += llm + tool
            acc[1] += won
            acc[2] += min(tool, won + gaps[task, r][i])
        else:  # served by the cache (its restore taken as free), or by a sibling's flight after ``tool`` seconds
            times[task, r][0] += llm + (tool if wait >= 0 else 0.0)
        for p in mine[task, r]:
            p.observe(ctx, key)
        for (t2, r2, i2), other in open_turns.items() if reask else ():
            if t2 == task:  # a sibling in its turn: what its predictors say now (a sibling's table learned this call)
                guesses = _classify(mine[t2, r2], other.ctx)
                for source, proposed in proposals(guesses).items():
                    seen = other.proposed.setdefault(source, {})
                    seen.update({k: max(v, seen.get(k, 0.0)) for k, v in proposed.items()})
                running = {o.key for o in other.launches} | ({key} if other.ctx.chain == ctx.chain else set())
                options = plan_launches(
                    guesses, in_flight=running, turn_elapsed=now - other.start,
                    veto=_keys_in(_vetoed(guesses, other.ctx.chain, made[t2], flights[t2], now)),
                    rollout=f"{t2}:{r2}", progress=i2, group=t2,
                )  # fmt: skip
                forks = sum(o.needs_fork for o in other.launches)
                more = policy.select(options, running=len(other.launches), forks=forks) if options else []
                for o in more:
                    stats[t2]["all"]["replanned"] += 1
                    if o.needs_fork:
                        policy.observe_fork(model.fork_seconds, round(model.fork_mib * _MIB))
                other.launches += more
    report.spent += policy.allowance.spent / _MIB
    report.earned += policy.allowance.earned / _MIB
    for task in tasks:
        report.rollouts[task] = [RolloutTime(*(round(x, 3) for x in times[task, r])) for r in range(len(groups[task]))]
        by = report.by_task.setdefault(task, {})
        for src in set(stats[task]) | set(sums[task]):
            row = {k: float(v) for k, v in stats[task][src].items()}
            row.update({k: round(v, 3) for k, v in sums[task][src].items()})
            if src != "all":
                row["calibration"] = round(policy.calibration(src), 3)  # the run's, at its end
            by[src] = row
