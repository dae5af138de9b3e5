#!/usr/bin/env python3
"""Offline, held-out evaluation of speculator's predictors on timed multi-rollout traces (no workspaces).

Usage: .venv/bin/python scripts/eval_predictors.py TRACES [--ngram [--table FILE | --leave-task-out [--calibrated]]]

Replays each task's rollouts as a GRPO group that starts together (``speculator._offline``) and reports, for the
default predictors together and for each one left out (the ablation), exact top-1 hits, launches (stated
probability >= 0.3, up to three per call), the hideable tool time their hits would hide (of the oracle's bound:
``min(tool, LLM)`` per call the prefix cache does not serve) and the tool time wrong launches would run. Two
ceilings say what any predictor limited to exact calls could reach: the calls the group made before (in time), and
those plus the calls other tasks made. The predictors are the experiment's (``fork+cache+spec``); ``--ngram`` adds
the n-gram predictors (``history``, ``signatures``; the experiment's ``-with-ngram``), whose table is the bundled
one (trained on other traces, SWE-bench) or, with ``--leave-task-out``, trained for each task on every other task
of TRACES: never on the task it predicts (``--calibrated``: its odds calibrated on those other tasks, as
``build_ngram_table.py`` calibrates the bundled one); each group gets its own copy (the history predictor learns
online into it).

A row re-asks the predictors whenever a sibling decides a call during a rollout's turn (what a runtime that plans
again on a sibling's decision could add; a guess first made then hides only what is left of the turn).

``--policy``: the runtime's launch decision replayed (``speculator._replay``), and each group's latency (its
slowest rollout's end) with the share of the oracle's gain as ``bench.experiment`` reports it, by the hits alone
and with the stream tap (``speculator._latency``); ``--reask``: with the runtime's re-plan on a sibling's decision.

Calibration: per predictor and tenth of stated probability, guesses and hit rate; and held out, each task's guesses
against the hit rates the other tasks' guesses scored. The traces hold no observations, so the observation
predictor is scored apart, told before each single-package pip install the error that would have named the package
(an upper bound of its hit rate: the entity is always right). Where the hideable time lies: by call kind, by
program, and by what could have named each call exactly when its turn started (a sibling before or during the turn,
the rollout's own earlier call, another task's call or its template with this rollout's names, a retry or variant
of an earlier call, nothing): what any exact-call predictor could reach.

Lead time: the oracle's hideable time if each branch started ``d`` seconds after the previous call's observation
(``min(tool, LLM - d)`` per call; ``--delays``), beside what the traces' timestamps say of the recorded agent's own
time between an observation and its next model request (``t_llm_start``) and of its shortest turns (an upper bound
of the time to a first token).
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bunshin_async._llm._turns import token_pieces  # noqa: E402
from bunshin_async.speculation import CallKey, Candidate, PredictionContext, Predictor  # noqa: E402
from speculator import (  # noqa: E402
    KIND_ODDS,
    NgramModel,
    ObservationPredictor,
    OraclePredictor,
    RecentPredictor,
    RunTimes,
    SiblingPredictor,
    SiblingTable,
    TimedPredictor,
    command_program,
    default_guesses,
    default_ngram,
    default_speculation,
    fit_odds,
    with_kind_odds,
)
from speculator._kinds import Guess, fit_held_out, shift_odds  # noqa: E402
from speculator._latency import RolloutTime, latency_share  # noqa: E402
from speculator._offline import (  # noqa: E402
    OfflineReport,
    Record,
    _calls,
    evaluate,
    leave_task_out,
    load_groups,
    load_observations,
    with_observations,
)
from speculator._replay import ByteModel, ReplayReport, replay  # noqa: E402
from speculator._steps import _stepped  # noqa: E402
from speculator._written import written_script  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from build_ngram_table import held_out_calibration  # noqa: E402

_DEFAULT = ByteModel()
PREDICTORS = ("siblings", "observation", "docs", "recent", "written", "steps")
NGRAM = ("history", "signatures")
# Ablations of a predictor's parts: (row, the predictor in place of the default one of its name, given the table).
VARIANTS: tuple[tuple[str, Callable[[SiblingTable], Predictor]], ...] = (
    ("all, siblings without the first-line level", lambda t: SiblingPredictor(t, head_confidence=0.0)),
    (
        "all, recent at one odds for every case (0.6)",
        lambda t: RecentPredictor(confidence=0.6, named=0.6, installed=0.6, written=0.6, rewritten=0.6),
    ),
)


class _Seen:
    """A ceiling: every call in ``known`` or made before in the group, each with probability 1."""

    name = "ceiling"

    def __init__(self, group: set[CallKey], known: frozenset[CallKey]) -> None:
        self.group, self.known = group, known

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        return [
            Candidate(name=k.name, arguments=k.arguments(), probability=1.0, source=self.name)
            for k in self.group | self.known
        ]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.group.add(call)


def _terminal(spec: str) -> dict[str, list[Record]]:
    """``terminal:N``: N groups (seeds 0..N-1) of the experiment's terminal workload, 4 rollouts each, as trace
    records: LLM times as generated (median 3.3 s), tool times the padded durations ``--pad-tools`` gives their
    commands (``bench.experiment._terminal.padded_seconds``). No observations, as in the traces."""
    from bench.experiment._terminal import padded_seconds, terminal_trajectories

    groups: dict[str, list[Record]] = {}
    for seed in range(int(spec.split(":", 1)[1])):
        for t in terminal_trajectories(4, seed=seed, llm_median=3.3):
            steps = [
                {"tool": s.tool, "args": s.args, "llm_seconds": s.llm_seconds,
                 "tool_seconds": padded_seconds(str((s.args or {}).get("command", "")))}
                for s in t.steps if s.tool
            ]  # fmt: skip
            groups.setdefault(f"terminal{seed}", []).append({"task_id": f"terminal{seed}", "rollout": t.rollout,
                                                             "steps": steps})  # fmt: skip
    return groups


def _model(groups: dict[str, list[Record]], calibrated: bool) -> NgramModel:
    """A model trained on ``groups`` (every other task), its odds calibrated on them out of sample if asked."""
    model = NgramModel(3)
    for records in groups.values():
        for r in records:
            model.add_record(r)
    if calibrated:
        rates = held_out_calibration(groups)
        model.calibration = {k: v for k, v in rates.items() if k in ("history", "signatures")}
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", type=Path, help="a trace file, or 'terminal:N': N seeded groups of the terminal workload")
    p.add_argument("--ngram", action="store_true", help="add the n-gram predictors (history, signatures)")
    p.add_argument("--table", type=Path, help="with --ngram: an n-gram table (default: the bundled one)")
    p.add_argument("--leave-task-out", action="store_true", help="per task, a table trained on the other tasks")
    p.add_argument(
        "--calibrated", action="store_true",
        help="with --leave-task-out: calibrate each task's table out of sample on the other tasks (slower)",
    )  # fmt: skip
    p.add_argument(
        "--delays", default="0,0.05,0.1,0.25,0.5,1,2",
        help="lead-time table: launch delays after the observation, seconds (comma-separated)",
    )  # fmt: skip
    q = p.add_argument_group("after the policy (--policy): the runtime's launch decision replayed")
    q.add_argument("--policy", action="store_true", help="only the tables after the runtime's policy")
    q.add_argument("--tasks", help="only these tasks (comma-separated)")
    q.add_argument("--together", action="store_true", help="the tasks in one run sharing one policy (else each alone)")
    q.add_argument("--time-scale", type=float, default=1.0, help="LLM and tool times x this (the experiment's)")
    q.add_argument("--fork-mib", type=float, default=_DEFAULT.fork_mib, help="a fork's bytes beside its rollout")
    q.add_argument("--rollout-mib", type=float, default=_DEFAULT.rollout_mib, help="a rollout's bytes")
    q.add_argument("--copy-extra-mib", type=float, default=_DEFAULT.copy_extra_mib, help="a copy's beyond its rollout")
    q.add_argument("--fork-seconds", type=float, default=_DEFAULT.fork_seconds, help="a fork's seconds")
    q.add_argument("--restore-seconds", type=float, default=_DEFAULT.restore_seconds,
                   help="a write the cache serves, on the main line (its restore)")  # fmt: skip
    q.add_argument("--cpu-share", type=float, default=_DEFAULT.cpu_share, help="CPU s per s of a main-line call")
    q.add_argument("--contention", type=float, default=_DEFAULT.contention, help="how busy the CPUs are, 0-1")
    q.add_argument("--memory-share", type=float, help="the policy's memory_share (default: its own)")
    q.add_argument("--making-mib", type=float, default=_DEFAULT.making_mib, help="a fork's making beyond the fork")
    q.add_argument("--install-mib", type=float, default=_DEFAULT.install_mib, help="an install's call in a fork")
    q.add_argument("--interpreter-mib", type=float, default=_DEFAULT.interpreter_mib, help="a python/node call's")
    q.add_argument("--install-seconds", type=float, default=_DEFAULT.install_seconds,
                   help="how long an install's call holds its bytes in a fork (inf: its whole run)")  # fmt: skip
    q.add_argument("--learned", action="store_true", help="the policy's priors until its first fork (the runtime's)")
    p.add_argument(
        "--run-times", action="store_true",
        help="guesses state their signature's mean run time on the other tasks (RunTimes, leave-task-out)",
    )  # fmt: skip
    q.add_argument("--why", type=float, metavar="S", help="list the right guesses refused whose call took >= S s")
    q.add_argument("--no-ablation", action="store_true", help="with --policy: skip the ablation rows")
    q.add_argument(
        "--reask", action="store_true",
        help="with --policy: a rollout in its turn plans again when a sibling decides a call (Speculation.signal)",
    )  # fmt: skip
    p.add_argument(
        "--odds", choices=("shipped", "held-out", "none"), default="shipped",
        help="odds by the kind of call: the shipped KIND_ODDS, fitted for each task on the other tasks, or none",
    )  # fmt: skip
    p.add_argument("--kinds", action="store_true", help="only fit the odds by kind: the table, and its held-out check")
    p.add_argument(
        "--observations", type=Path, action="append", default=[],
        help="what an online run printed (bench.experiment --observations; repeatable): each call's output is the "
        "next turn's last_output, as the runtime gives it (the traces hold none)",
    )  # fmt: skip
    args = p.parse_args()
    if (args.table or args.leave_task_out) and not args.ngram:
        p.error("--table and --leave-task-out are about the n-gram predictors: add --ngram")
    args.predictors = PREDICTORS + NGRAM if args.ngram else PREDICTORS
    groups = every = (
        _terminal(args.traces.name) if str(args.traces).startswith("terminal:") else load_groups(args.traces)
    )
    if args.observations:
        observed = [o for path in args.observations for o in load_observations(path)]
        groups, matched = with_observations(every, observed)
        calls = sum(len(_calls(r)) for rs in every.values() for r in rs)
        print(f"observations: {matched} of {calls} calls given what an online run printed "
              f"({', '.join(map(str, args.observations))})\n")  # fmt: skip
        every = groups
    if args.tasks:
        wanted = args.tasks.split(",")
        missing = [t for t in wanted if t not in groups]
        if missing:
            p.error(f"no such task in {args.traces.name}: {', '.join(missing)}")
        groups = {t: groups[t] for t in wanted}
    others = dict(leave_task_out(groups))
    bundled = NgramModel.from_table(args.table.read_bytes()) if args.table else default_ngram()
    models: dict[str, NgramModel] = {}
    if args.leave_task_out:
        for task in groups:
            models[task] = _model({t: rs for t, rs in every.items() if t != task}, args.calibrated)
    # run times by signature, for each task learned from every other task of TRACES (never from the task itself)
    times = {task: RunTimes.from_records(r for t, rs in every.items() if t != task for r in rs) for task in groups}
    # odds by the kind of call, for each task: the shipped table, or fitted on the guesses of every other task
    odds: dict[str, Mapping[str, Mapping[str, float]]] = dict.fromkeys(
        groups, KIND_ODDS if args.odds == "shipped" else {}
    )

    def speculation(
        without: frozenset[str], variant: Callable[[SiblingTable], Predictor] | None = None, timed: bool | None = None
    ) -> Callable[[str], Callable[[], Sequence[Predictor]]]:
        """The default predictors but ``without``; ``variant`` replaces the one of its name (made otherwise);
        ``timed``: their guesses state run times (``RunTimes``, leave-task-out; default: ``--run-times``)."""
        timed = args.run_times if timed is None else timed

        def make(task: str) -> Callable[[], Sequence[Predictor]]:
            # a copy per group: the history predictor learns online into its model, and a model shared by the
            # rows would have learned the task it predicts from an earlier row
            table = SiblingTable()
            model = copy.deepcopy(models.get(task, bundled)) if args.ngram else None

            def one() -> list[Predictor]:
                spec = default_speculation(
                    group=task, table=table, model=model, without=without, times=times[task] if timed else None,
                    odds=odds[task],
                )  # fmt: skip
                predictors = list(spec.predictors)
                if variant is not None:
                    made = with_kind_odds([variant(table)], odds[task])[0]
                    if timed:
                        made = TimedPredictor(made, times[task])
                    predictors = [made if p.name == made.name else p for p in predictors]
                return predictors

            return one

        return make

    if args.kinds or args.odds == "held-out":
        scored = default_guesses(every, lambda task: copy.deepcopy(models.get(task, bundled)) if args.ngram else None)
        fits = fit_held_out(scored, every)
        if args.odds == "held-out":
            odds.update((task, fits[task]) for task in groups)
        if args.kinds:
            _kinds_report(scored, fits)
            return 0

    if args.policy:
        model = ByteModel(
            fork_mib=args.fork_mib, rollout_mib=args.rollout_mib, copy_extra_mib=args.copy_extra_mib,
            fork_seconds=args.fork_seconds, restore_seconds=args.restore_seconds, cpu_share=args.cpu_share,
            contention=args.contention, learned=args.learned,
            making_mib=args.making_mib, install_mib=args.install_mib, interpreter_mib=args.interpreter_mib,
            install_seconds=args.install_seconds,
            memory_share=args.memory_share,
        )  # fmt: skip
        _after_policy(groups, speculation, model, args, times)
        return 0
    rows: list[tuple[str, OfflineReport, str]] = [("all predictors", evaluate(groups, speculation(frozenset())), "all")]
    for name in args.predictors:
        rows.append((f"all but {name}", evaluate(groups, speculation(frozenset({name}))), "all"))
        rows.append((f"{name} alone", evaluate(groups, speculation(frozenset(args.predictors) - {name})), "all"))
    if args.ngram:
        rows.append(("all but history and signatures", evaluate(groups, speculation(frozenset(NGRAM))), "all"))

    # what this session's refinements add: each predictor made as before them, in place of its current form
    for label, variant in VARIANTS:
        rows.append((label, evaluate(groups, speculation(frozenset(), variant)), "all"))
    reasked = evaluate(groups, speculation(frozenset()), reask=True)
    rows.append(("all, asked again whenever a sibling decides during the turn", reasked, "all"))

    def ceiling(cross: bool) -> Callable[[str], Callable[[], Sequence[Predictor]]]:
        def make(task: str) -> Callable[[], Sequence[Predictor]]:
            known = frozenset(k for r in others[task] for k, _, _ in _calls(r)) if cross else frozenset()
            group: set[CallKey] = set()
            return lambda: [_Seen(group, known)]

        return make

    rows.append(("ceiling: calls the group made before", evaluate(groups, ceiling(False), top=1 << 30), "ceiling"))
    rows.append(("ceiling: those + other tasks' calls", evaluate(groups, ceiling(True), top=1 << 30), "ceiling"))
    first = rows[0][1]
    table = "bundled (other traces)" if not args.leave_task_out else "leave-task-out (the other tasks of TRACES)"
    table = table if args.ngram else "none (no n-gram predictors; --ngram)"
    table += ", calibrated out of sample" if args.leave_task_out and args.calibrated else ""
    print(f"{args.traces.name}: {len(groups)} groups, {first.calls} calls, {first.cache_hits} served by the "
          f"prefix cache; hideable tool time (the oracle's bound) {first.hideable_seconds:.0f} s; n-gram table: "
          f"{table}\n")  # fmt: skip
    print("| predictors | exact top-1 | launched | hits launched | hidden s | share of hideable | wrong launches' s |")
    print("|---|---|---|---|---|---|---|")
    for label, rep, source in rows:
        s = rep.by_source.get(source, {})
        print(f"| {label} | {100 * s.get('top1_rate', 0):.1f}% | {s.get('launched', 0):.0f} | "
              f"{s.get('committed', 0):.0f} | {s.get('hidden_seconds', 0):.1f} | {100 * rep.share(source):.1f}% | "
              f"{s.get('wasted_seconds', 0):.0f} |")  # fmt: skip
    print("\nCalibration of the default predictors (stated probability tenth: guesses, hit rate):")
    for source, bins in first.calibration.items():
        print(f"  {source}: " + ", ".join(f"{lo:.1f}: {n} {h / n:.0%}" for lo, n, h in bins))
    _held_out_calibration(groups, speculation(frozenset()))
    _observation_forms(groups)
    _where(groups, every)
    _lead_time(groups, [float(d) for d in args.delays.split(",") if d])
    return 0


def _kinds_report(scored: list[Guess], fits: dict[str, dict[str, dict[str, float]]]) -> None:
    """The odds factors fitted on every task (what ``KIND_ODDS`` ships), and the check of held-out factors: each
    task's guesses (stated at least 0.05) against the factors fitted on the other tasks."""
    print("Odds factors by kind, fitted on every task (speculator._kinds.KIND_ODDS):")
    print(fit_odds(g[1:] for g in scored))
    cells: dict[tuple[str, str], list[float]] = {}
    for task, source, kind, p, hit in scored:
        if not 0.05 <= p < 1.0:
            continue
        q = shift_odds(p, fits[task].get(source, {}).get(kind, 1.0))
        c = cells.setdefault((source, kind), [0, 0, 0.0, 0.0, 0.0, 0.0])
        c[0] += 1
        c[1] += hit
        c[2] += p
        c[3] += q
        c[4] -= math.log(p if hit else 1 - p)
        c[5] -= math.log(q if hit else 1 - q)
    print(
        "\nHeld out (each task under the factors fitted on the other tasks): guesses stated >= 0.05, hits, the hits "
        "their stated odds expected, those the held-out factors expected, and the log loss (nats) before / after"
    )
    print("| source | kind | guesses | hits | expected, stated | expected, held-out | log loss stated / held-out |")
    print("|---|---|---|---|---|---|---|")
    total = [0.0, 0.0]
    for (source, kind), (n, h, e, q, before, after) in sorted(cells.items()):
        total[0], total[1] = total[0] + before, total[1] + after
        print(f"| {source} | {kind} | {n:.0f} | {h:.0f} | {e:.1f} | {q:.1f} | {before:.1f} / {after:.1f} |")
    print(f"| **all** | | | | | | {total[0]:.1f} / {total[1]:.1f} |")


class _TimedOracle(OraclePredictor):
    """The oracle, its guesses stating their recorded run time (``expected_seconds``, x ``scale``)."""

    def __init__(self, calls: Sequence[tuple[CallKey, float, float]], scale: float) -> None:
        super().__init__([(k.name, k.arguments()) for k, _, _ in calls])
        self.seconds = [tool * scale for _, _, tool in calls]

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        n = len(ctx.history)
        return [msgspec.structs.replace(c, expected_seconds=self.seconds[n]) for c in super().predict(ctx)]


def _oracle(
    groups: dict[str, list[Record]], scale: float | None = None
) -> Callable[[str], Callable[[], Sequence[Predictor]]]:
    """Per rollout, the experiment's oracle: told its true calls (``scale``: and their run times, x scale)."""

    def make(task: str) -> Callable[[], Sequence[Predictor]]:
        records = iter(groups[task])

        def one() -> list[Predictor]:
            calls = _calls(next(records))
            if scale is not None:
                return [_TimedOracle(calls, scale)]
            return [OraclePredictor([(k.name, k.arguments()) for k, _, _ in calls])]

        return one

    return make


_REFUSED = (
    "odds",
    "latency",
    "GiB·s",
    "fork budget",
    "group forks",
    "branches",
    "cached",
    "unspeculable",
    "unexplained",
)


def _tap(call: CallKey, llm: float) -> float:
    """How long before its message's end the stream tap starts ``call``, as the experiment's replay server streams
    it (``RecordedTiming(ttft=0.05)``, ``separate_finish``): the turn's tokens (the call's name, then its arguments
    in ``token_pieces``; the traces hold no assistant text) spread evenly from the first token to the recorded LLM
    time, the finish one interval after the last."""
    n = 1 + len(token_pieces(call.args.decode()))
    return (llm - min(0.05, llm)) / (n - 1) if n > 1 else 0.0


def _latency(groups: dict[str, list[Record]], rep: ReplayReport, oracle: ReplayReport, together: bool) -> None:
    """Each group's latency (its slowest rollout's end) and the share of the oracle's gain, as the experiment
    reports them (``speculator._latency``), with the stream tap and without it (the hits alone)."""
    runs = [list(groups)] if together else [[t] for t in groups]
    print(
        "\nGroup latency (its slowest rollout's end, s; rollout #): fork+cache; the predictors' hits alone / with "
        "the stream tap; the oracle's likewise\n| group | fork+cache | predictors | oracle |\n|---|---|---|---|"
    )
    for task in groups:

        def cell(rs: list[RolloutTime], tap: bool) -> str:
            late = max(range(len(rs)), key=lambda k: rs[k].latency(tap=tap))
            return f"{rs[late].latency(tap=tap):.1f} (#{late})"

        base = rep.rollouts[task]
        late = max(range(len(base)), key=lambda k: base[k].seconds)
        print(f"| {task} | {base[late].seconds:.1f} (#{late}) | {cell(base, False)} / {cell(base, True)} | "
              f"{cell(oracle.rollouts[task], False)} / {cell(oracle.rollouts[task], True)} |")  # fmt: skip
    print("\n| share of the oracle's gain | run latency: gain, oracle's, share | mean group latency: gain, "
          "oracle's, share |\n|---|---|---|")  # fmt: skip
    for label, tap in (("hits alone", False), ("with the stream tap (as the experiment counts)", True)):
        s = latency_share(rep.rollouts, oracle.rollouts, runs=runs, tap=tap)
        share = "-" if s.share is None else f"{100 * s.share:.0f}%"
        mean_share = "-" if s.mean_share is None else f"{100 * s.mean_share:.0f}%"
        print(f"| {label} | {100 * s.gain:.2f}%, {100 * s.oracle_gain:.2f}%, {share} | {100 * s.mean_gain:.2f}%, "
              f"{100 * s.oracle_mean_gain:.2f}%, {mean_share} |")  # fmt: skip


def _row(label: str, s: dict[str, float], hideable: float) -> str:
    hidden = s.get("hidden", 0.0)
    refused = " / ".join(f"{s.get(r, 0):.0f}" for r in _REFUSED)
    return (f"| {label} | {s.get('offered', 0):.0f} | {s.get('launched', 0):.0f} ({s.get('forks', 0):.0f}) | "
            f"{s.get('hits', 0):.0f} | {hidden:.1f} | {100 * hidden / hideable if hideable else 0:.1f}% | "
            f"{s.get('wrong', 0):.1f} | {s.get('held', 0):.1f} / {s.get('freed', 0):.1f} | {refused} |")  # fmt: skip


def _after_policy(
    groups: dict[str, list[Record]],
    speculation: Callable[..., Callable[[str], Callable[[], Sequence[Predictor]]]],
    model: ByteModel,
    args: argparse.Namespace,
    times: dict[str, RunTimes],
) -> None:
    """The tables after the runtime's launch decision (``speculator._replay``): per task, per predictor, the
    experiment's oracle under the same policy, and the ablation (each predictor left out, each alone)."""
    fixed = {"model": model, "time_scale": args.time_scale, "together": args.together, "tap": _tap}
    run = {**fixed, "reask": args.reask}
    rep = replay(groups, speculation(frozenset()), **run)
    oracle = replay(groups, _oracle(groups), **fixed)  # told the calls: a sibling's decision tells it nothing more
    timed = replay(groups, _oracle(groups, args.time_scale), **fixed)
    hideable = sum(rep.hideable.values())
    print(f"{args.traces.name}: {len(groups)} groups ({'one run' if args.together else 'each its own run'}), "
          f"{sum(rep.calls.values())} calls, x {args.time_scale:g}; hideable {hideable:.1f} s; policy told: fork "
          f"{model.fork_mib} MiB, {model.fork_seconds} s, a cache's restore {model.restore_seconds} s, rollout "
          f"{model.rollout_mib} MiB, copy "
          f"{model.copy_extra_mib:+} MiB, CPU share {model.cpu_share}, contention {model.contention}"
          f"{', learned after its first fork' if model.learned else ''}; making {model.making_mib} MiB, calls: "
          f"install {model.install_mib} MiB for {model.install_seconds} s, interpreter {model.interpreter_mib} MiB; "
          f"predictors: "
          f"{', '.join(args.predictors)}")  # fmt: skip
    print(f"memory by the policy's terms, MiB·s: forks' net cost {rep.spent:.1f} (oracle {oracle.spent:.1f}) against "
          f"the main lines' {rep.earned:.1f} as it estimates them ({oracle.earned:.1f})\n")  # fmt: skip
    head = ("| {} | offered | launched (forks) | hits | hidden s | share of hideable | wrong s | fork MiB·s held / "
            "freed | refused: " + " / ".join(_REFUSED) + " |")  # fmt: skip
    rule = "|---" * 9 + "|"
    print(head.format("task: predictors, oracle") + "\n" + rule)
    for task in groups:
        h = rep.hideable[task]
        print(_row(f"{task} ({h:.1f} s hideable)", rep.total(tasks=[task]), h))
        print(_row(f"{task}: oracle", oracle.total(tasks=[task]), h))
    print(_row("**all**", rep.total(), hideable))
    other = replay(groups, speculation(frozenset(), timed=not args.run_times), **run)
    label = "all, guesses without run times" if args.run_times else "all, guesses stating run times (leave-task-out)"
    print(_row(f"**{label}**", other.total(), hideable))
    print(_row("**all: oracle**", oracle.total(), hideable))
    print(_row("**all: oracle, its guesses stating their run time**", timed.total(), hideable))

    def told(task: str) -> Callable[[], Sequence[Predictor]]:
        records, table = iter(groups[task]), SiblingTable()
        if args.run_times:
            return lambda: [TimedPredictor(_Told(next(records), table), times[task])]
        return lambda: [_Told(next(records), table)]

    print(_row("observation alone, told each single-package install's package (upper bound)",
               replay(groups, told, **run).total(), hideable))  # fmt: skip
    _latency(groups, rep, oracle, args.together)
    print("\nBy predictor (the source of the option the policy weighed)\n" + head.format("predictor") + "\n" + rule)
    for source in rep.sources():
        print(_row(source, rep.total(source), hideable))
    print("\nThe right guesses (an offered option that was the next call): how many, and the hideable seconds of "
          "those each rule refused\n| predictor | right offered | launched | " + " | ".join(_REFUSED) + " |\n"
          + "|---" * (3 + len(_REFUSED)) + "|")  # fmt: skip
    for source, t in [*((s, rep.total(s)) for s in rep.sources()), ("all", rep.total()), ("oracle", oracle.total())]:
        cells = " | ".join(f"{t.get(f'right {r}', 0):.0f}: {t.get(f'right {r} s', 0):.1f} s" for r in _REFUSED)
        print(f"| {source} | {t.get('right offered', 0):.0f} | {t.get('right launched', 0):.0f}: "
              f"{t.get('right launched s', 0):.1f} s | {cells} |")  # fmt: skip
    if args.why is not None:
        print("\nEach right guess refused (p: the policy's calibrated odds; run: the seconds it expected; saving: its "
              "latency gain, s; net: memory_net, MiB·s)")  # fmt: skip
        for f in [*rep.refused, *oracle.refused]:
            if f.reason not in ("cached",) and f.tool >= args.why:
                num = " ".join(f"{n} {v:.2f}" for n, v in (("p", f.probability), ("run", f.expected),
                               ("saving", f.saving), ("net", f.memory_net)) if v is not None)  # fmt: skip
                print(f"  {f.task}#{f.rollout}.{f.index} {f.source} {f.reason}: LLM {f.llm:.1f} s, "
                      f"tool {f.tool:.1f} s, {num}: {f.command!r}")  # fmt: skip

    if args.no_ablation:
        return
    print("\nAblation after the policy\n" + head.format("predictors") + "\n" + rule)
    print(_row("all", rep.total(), hideable))
    for name in args.predictors:
        print(_row(f"all but {name}", replay(groups, speculation(frozenset({name})), **run).total(), hideable))
        alone = replay(groups, speculation(frozenset(args.predictors) - {name}), **run).total()
        print(_row(f"{name} alone", alone, hideable))
    if args.ngram:
        both = replay(groups, speculation(frozenset(NGRAM)), **run).total()
        print(_row("all but history and signatures", both, hideable))


# What could name a call when its turn starts (``_Where``), in the order a call is counted under the first that
# applies; the table also says, for each, the hideable time of every call it applies to.
_SOURCES = (
    "a sibling decided it before the turn started",
    "a sibling decided it during the turn (asked again then)",
    "the rollout's own earlier call, again",
    "another task's rollout made it",
    "another task's call with names from this rollout's earlier calls (a template)",
    "a retry: a one-line call with the program and a name of an earlier call that ran to its timeout (>= 25 s)",
    "a variant: a one-line call with the program and a name of an earlier call",
    "nothing before it (new text, a new name)",
)
_WORD = re.compile(r"[A-Za-z_][\w.+-]*[\w+]|[A-Za-z_]")


def _command(call: CallKey) -> str:
    command = call.arguments().get("command")
    return command if isinstance(command, str) else ""


class _Where:
    """Records, for one rollout, each call's hideable time and what, known when its turn started, could have named
    it exactly (``_SOURCES``): a sibling (the group's ``made``: call -> (event count, rollout) when first decided),
    the rollout's own calls, another task (``elsewhere``: its calls; ``templates``: its calls with the names its
    rollout had used before cut out), a retry or variant of an earlier call (same program, a name in common)."""

    name = "where"

    def __init__(self, task: str, record: Record, rollout: int, group: dict[str, Any], elsewhere: set[CallKey],
                 templates: set[str], common: frozenset[str], out: dict[tuple[str, str], float]) -> None:  # fmt: skip
        self.task, self.rollout, self.group, self.out = task, rollout, group, out
        self.elsewhere, self.templates, self.common = elsewhere, templates, common
        steps = [s for s in record.get("steps", ()) if s.get("tool") and s.get("kind") != "format_error"]
        self.kinds = [(s.get("kind") or "?", s.get("program") or "?") for s in steps]
        self.calls = _calls(record)
        self.started = 0

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        self.started = self.group["events"]
        return []

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        group = self.group
        group["events"] += 1
        i = len(ctx.history)
        _, llm, tool = self.calls[i]
        cached = (ctx.chain, call) in group["chains"]
        group["chains"].add((ctx.chain, call))
        first = group["made"].setdefault(call, (group["events"], self.rollout))
        if cached:
            return
        hideable = min(llm, tool)
        sources = _sources(self, ctx.history, call, first)
        kind, program = self.kinds[i]
        keys = [("origin", sources[0]), ("kind", kind), ("program", program)]
        keys += [("any", s) for s in sources]
        if sources[0] not in _SOURCES[:4]:
            keys.append(("signal", _signal(ctx.history, call, kind, program)))
        for key in keys:
            self.out[key] = self.out.get(key, 0.0) + hideable


def _names(command: str, common: frozenset[str]) -> set[str]:
    """The words of a command that name something of its task (a package, a file, a URL's parts): those that are
    not among the words most tasks' commands use (``common``: pip, install, python3, -y ...)."""
    return {w for w in _WORD.findall(command) if w not in common}


def _template(command: str, names: set[str]) -> str:
    return _WORD.sub(lambda m: "\x00" if m.group(0) in names else m.group(0), command)


def _sources(w: _Where, history: Sequence[CallKey], call: CallKey, first: tuple[int, int]) -> list[str]:
    """Every ``_SOURCES`` entry that applies to ``call`` (at least the last)."""
    out = []
    if first[1] != w.rollout:
        out.append(_SOURCES[0] if first[0] <= w.started else _SOURCES[1])
    if call in history:
        out.append(_SOURCES[2])
    if call in w.elsewhere:
        out.append(_SOURCES[3])
    command = _command(call)
    earlier = [_command(k) for k in history]
    used = set().union(*(_names(c, w.common) for c in earlier)) if earlier else set()
    template = _template(command, used)
    if "\x00" in template and template in w.templates:
        out.append(_SOURCES[4])
    program, names = command_program(command), _names(command, w.common)
    # new text (a heredoc, ``python -c``) is no retry or variant of an earlier call, whatever names it shares
    one_line = "\n" not in command.strip()
    related = [
        j for j, c in enumerate(earlier) if one_line and command_program(c) == program and names & _names(c, w.common)
    ]
    if any(w.calls[j][2] >= 25.0 for j in related):
        out.append(_SOURCES[5])
    elif related:
        out.append(_SOURCES[6])
    return [*out, _SOURCES[7]]


def _first(call: CallKey) -> str:
    command = call.arguments().get("command")
    return command.split("\n", 1)[0] if isinstance(command, str) else ""


def _signal(history: Sequence[CallKey], call: CallKey, kind: str, program: str) -> str:
    """What, known when the turn starts, names a call made nowhere before: the rollout's own actions (a script it
    wrote, a run it steps through, a module it imported or looked for), or nothing but new text or an observation."""
    line = _first(call)
    if kind == "install":
        named = {
            m for c in history[-3:] for m in re.findall(r"(?:\bimport|\bfrom|\bwhich)\s+([\w-]+)", c.args.decode())
        }
        if any(re.search(rf"(?<![\w-]){re.escape(m)}(?![\w-])", line) for m in named if len(m) > 1):
            return "an install of a module the last three commands import or look for"
        return "an install of what only an observation names"
    for back, earlier in enumerate(reversed(history[-6:])):
        path = written_script(_first(earlier))
        if path is not None and "\n" not in call.args.decode():
            base = path.rsplit("/", 1)[-1]
            if re.search(rf"(?<![\w.-]){re.escape(base)}(?![\w-])", line):
                return "a run of the script the previous call wrote" if back == 0 else (
                    "a run of a script written 2-6 calls before")  # fmt: skip
            break
    command = call.arguments().get("command")
    previous = [c for k in history[-9:-1] if isinstance(c := k.arguments().get("command"), str)]
    if history and isinstance(command, str) and _stepped(_first(history[-1]), previous) == command:
        return "the next step of a run stepped through"
    if program in ("cat >", "python -c") or "<<" in line:
        return "new text (a heredoc, python -c)"
    return "other"


def _where(groups: dict[str, list[Record]], every: dict[str, list[Record]]) -> None:
    """Where the hideable time lies: by call kind, by program (the largest ten), by what could have named each call
    exactly when its turn started (``_SOURCES``; another task: of ``every``, the whole trace file), and for calls
    no sibling, earlier call or other task's call names, by what at the turn's start names them."""
    commands = {t: [_command(k) for r in rs for k, _, _ in _calls(r)] for t, rs in every.items()}
    spread = Counter(w for cs in commands.values() for w in set().union(*map(set, map(_WORD.findall, cs))))
    common = frozenset(w for w, n in spread.items() if n >= 0.2 * len(every))  # in a fifth of the tasks or more
    templates: dict[str, set[str]] = {}
    for task, records in every.items():
        made = templates.setdefault(task, set())
        for r in records:
            used: set[str] = set()
            for k, _, _ in _calls(r):
                template = _template(_command(k), used)
                if "\x00" in template:
                    made.add(template)
                used |= _names(_command(k), common)
    by_task = {t: {k for r in rs for k, _, _ in _calls(r)} for t, rs in every.items()}
    out: dict[tuple[str, str], float] = {}

    def make(task: str) -> Callable[[], Sequence[Predictor]]:
        records = iter(enumerate(groups[task]))
        group: dict[str, Any] = {"events": 0, "made": {}, "chains": set()}
        elsewhere = {k for t, ks in by_task.items() if t != task for k in ks}
        known = {x for t, ts in templates.items() if t != task for x in ts}
        return lambda: [_Where(task, *next(records)[::-1], group, elsewhere, known, common, out)]

    total = evaluate(groups, make).hideable_seconds
    print(
        "\nWhat could name each call exactly when its turn starts (hideable s of the calls counted under the first "
        "that applies, and of every call it applies to; the traces hold no task text or files)"
    )
    print("| information at the launch | hideable s, first that applies | share | hideable s, any that applies |")
    print("|---|---|---|---|")
    for label in _SOURCES:
        first, any_ = out.get(("origin", label), 0.0), out.get(("any", label), 0.0)
        print(f"| {label} | {first:.1f} | {100 * first / total if total else 0:.1f}% | {any_:.1f} |")
    for what in ("kind", "program", "signal"):
        print(f"\nHideable tool time by {what}:")
        rows = sorted(((label, v) for (w, label), v in out.items() if w == what), key=lambda x: -x[1])
        for label, seconds in rows[:10]:
            print(f"  {label}: {seconds:.1f} s ({100 * seconds / total:.1f}%)")


# Options of ``pip install`` that take a value as the next word.
_PIP_VALUED = frozenset({"--index-url", "--extra-index-url", "-i", "--timeout", "-c", "--constraint", "-t", "--target"})


def _installed(call: CallKey) -> str | None:
    """The one package a command's one ``pip install`` names (version aside), if it is also a module's name."""
    command = call.arguments().get("command")
    if not isinstance(command, str) or "\n" in command:
        return None
    segments = [s.split() for s in re.split(r"&&|\|\||;|\|", command)]
    pips = [w for w in segments if "install" in w and any(re.fullmatch(r"pip3?(\.\d+)?", x) for x in w)]
    if len(pips) != 1:
        return None
    words = pips[0][pips[0].index("install") + 1 :]
    names = [w for i, w in enumerate(words) if not w.startswith("-") and (i == 0 or words[i - 1] not in _PIP_VALUED)]
    if len(names) != 1:
        return None
    m = re.fullmatch(r"([A-Za-z_]\w*)(?:[=<>~!]=?[\w.*]+)?", names[0])
    return m.group(1) if m else None


class _Told:
    """An ``ObservationPredictor`` told, before each single-package pip install, the observation that would have
    named its package (``No module named 'x'``), and no observation otherwise: what its guesses score when the
    entity is right, an upper bound of its hit rate (the traces hold no observations)."""

    name = "observation"

    def __init__(self, record: Record, table: SiblingTable) -> None:
        self.inner = ObservationPredictor(table)
        self.calls = [k for k, _, _ in _calls(record)]

    def _ctx(self, ctx: PredictionContext) -> PredictionContext:
        package = _installed(self.calls[len(ctx.history)])
        if package is None:
            return ctx
        return msgspec.structs.replace(ctx, last_output=f"ModuleNotFoundError: No module named '{package}'")

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        return self.inner.predict(self._ctx(ctx))

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.inner.observe(self._ctx(ctx), call)


def _observation_forms(groups: dict[str, list[Record]]) -> None:
    """How often the observation predictor's filled call is exactly the next one when the error named what the
    next call installs (its own form, then its siblings'): the most its odds could be."""

    def make(task: str) -> Callable[[], Sequence[Predictor]]:
        records, table = iter(groups[task]), SiblingTable()
        return lambda: [_Told(next(records), table)]

    rep = evaluate(groups, make)
    n = sum(1 for rs in groups.values() for r in rs for k, _, _ in _calls(r) if _installed(k) is not None)
    s = rep.by_source.get("observation", {})
    print(f"\nThe observation predictor told the package of each of the {n} single-package pip installs before it "
          f"(an upper bound: the error named what was installed next): {s.get('launched', 0):.0f} launched, "
          f"{s.get('committed', 0):.0f} hits, {s.get('hidden_seconds', 0):.1f} s hidden "
          f"({100 * rep.share('observation'):.1f}%), wrong launches {s.get('wasted_seconds', 0):.0f} s")  # fmt: skip
    _held_out_calibration(groups, make, "so told")


def _held_out_calibration(
    groups: dict[str, list[Record]], make: Callable[[str], Callable[[], Sequence[Predictor]]], told: str = ""
) -> None:
    """Each task's guesses scored against the hit rates the other tasks' guesses of the same source and stated
    tenth scored (leave-task-out): what a calibration fitted on other tasks would have expected, and what hit."""
    per_task = {task: evaluate({task: records}, make).calibration for task, records in groups.items()}
    totals: dict[tuple[str, float], list[int]] = {}
    for calib in per_task.values():
        for source, bins in calib.items():
            for lo, n, h in bins:
                t = totals.setdefault((source, lo), [0, 0])
                t[0], t[1] = t[0] + n, t[1] + h
    rows: dict[tuple[str, float], list[float]] = {}  # guesses, hits, expected from the other tasks
    for calib in per_task.values():
        for source, bins in calib.items():
            if source == "all":
                continue
            for lo, n, h in bins:
                n_all, h_all = totals[source, lo]
                rate = (h_all - h) / (n_all - n) if n_all > n else lo + 0.05
                row = rows.setdefault((source, lo), [0.0, 0.0, 0.0])
                row[0], row[1], row[2] = row[0] + n, row[1] + h, row[2] + n * rate
    print(f"\nHeld out (leave-task-out){', ' + told if told else ''}: per source and stated tenth, guesses, hits, "
          "the hits the other tasks' rates")  # fmt: skip
    print("expected, and the hit rate")
    print("| source | stated | guesses | hits | expected from other tasks | hit rate |")
    print("|---|---|---|---|---|---|")
    for (source, lo), (guesses, hits, e) in sorted(rows.items()):
        if guesses >= 5:
            rate = hits / guesses
            print(f"| {source} | {lo:.1f}-{lo + 0.1:.1f} | {guesses:.0f} | {hits:.0f} | {e:.1f} | {rate:.0%} |")


def _lead_time(groups: dict[str, list[Record]], delays: list[float]) -> None:
    """The oracle's hideable time by launch delay, and the traces' own gaps and shortest turns."""
    rep = evaluate(groups, lambda task: lambda: [], delays=delays)
    bound = dict(rep.hideable_after).get(0.0, rep.hideable_seconds)
    print("\nLead time: the oracle's hideable tool time if every branch started d s after the previous observation")
    print("| d (s) | hideable s | share of the bound at d = 0 |")
    print("|---|---|---|")
    for d, seconds in rep.hideable_after:
        print(f"| {d:g} | {seconds:.1f} | {100 * seconds / bound if bound else 0:.1f}% |")
    gaps, shortest = [], []
    for records in groups.values():
        for r in records:
            steps = [s for s in r.get("steps", ()) if s.get("t_llm_start") is not None]
            gaps += [
                b["t_llm_start"] - (a["t_llm_start"] + (a.get("llm_seconds") or 0.0) + (a.get("tool_seconds") or 0.0))
                for a, b in zip(steps, steps[1:], strict=False)
            ]
            turns = [s["llm_seconds"] for s in steps if s.get("llm_seconds")]
            if turns:
                shortest.append(min(turns))
    if gaps:
        q = sorted(gaps)
        p90 = q[int(0.9 * (len(q) - 1))]
        print(f"\nRecorded agent, observation to its next model request (t_llm_start): {len(q)} gaps, median "
              f"{1000 * statistics.median(q):.0f} ms, p90 {1000 * p90:.0f} ms, sum {sum(q):.1f} s")  # fmt: skip
    if shortest:
        print(f"Shortest turn per rollout (an upper bound of its time to first token): median "
              f"{statistics.median(shortest):.2f} s, min {min(shortest):.2f} s")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
