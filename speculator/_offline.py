"""Offline evaluation of predictors on timed multi-rollout traces, without workspaces: what each predictor would
have guessed, and how much of the hideable tool time its guesses would have hidden.

The rollouts of a group start together (as GRPO samples do) and follow their recorded times: turn ``i`` of a
rollout starts once its previous call's observation is known, and its call is decided ``llm_seconds`` later. At
every turn start the predictors are asked (their context: the rollout's calls so far; the group's shared table has
learned what siblings decided before that moment), then told the call at its decision time. Hideable time of a
call: ``min(tool_seconds, llm_seconds)`` (a branch started at the turn's start hides at most the turn's LLM time),
except for calls the prefix cache serves (a sibling already made the same call after the same history), which
speculation does not need to hide. Observations are not in the traces (only their length): predictors that read
``last_output`` see nothing here, unless a record's steps carry an ``observation`` (``with_observations`` attaches
what an online run of the same trajectories printed, as ``bench.experiment --observations`` records it): then each
turn's ``last_output`` is the previous call's, as the runtime gives it.
"""

from __future__ import annotations

import gzip
import heapq
import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec

from bunshin_async.speculation import CallKey, Candidate, PredictionContext, Predictor, chain_root, extend_chain
from bunshin_async.tools import bash_tool

__all__ = [
    "OBSERVATION_CHARS",
    "ObservedCall",
    "OfflineReport",
    "calibration",
    "evaluate",
    "leave_task_out",
    "load_groups",
    "load_observations",
    "with_observations",
]

Record = dict[str, Any]
_BASH_VERSION = bash_tool().version

#: Characters of one call's output an observation record keeps (its head and tail, the middle elided as the agent
#: elides what the model is told: ``bunshin_async.agent.observation``'s default).
OBSERVATION_CHARS = 10_000


class ObservedCall(msgspec.Struct, frozen=True):
    """What one call printed in an online run (``bench.experiment --observations``), one JSON line each: the run's
    configuration and repeat, the group (task id), rollout and index of the call among the rollout's calls, its
    tool and arguments (to match it against a trace's call) and ``output``: stdout then stderr, as the runtime's
    ``PredictionContext.last_output`` (without the ``exit code N`` line the model is told), bounded to
    ``OBSERVATION_CHARS`` and scrubbed of what differs between runs of the same call (the experiment's ``scrub``)."""

    config: str
    repeat: int
    task_id: str
    rollout: int
    index: int
    tool: str
    args: dict[str, Any]
    exit_code: int | None
    output: str


_EXIT_LINE = re.compile(r"\Aexit code -?\d+\n")


def bounded_output(observation: str, limit: int = OBSERVATION_CHARS) -> str:
    """What the runtime's ``last_output`` holds of a call the model was told ``observation`` of: without the
    ``exit code N`` line, at most ``limit`` characters (head and tail)."""
    text = _EXIT_LINE.sub("", observation, count=1)
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters elided ...]\n{text[-half:]}"


def load_observations(path: str | os.PathLike[str]) -> list[ObservedCall]:
    """The records of an observation file (JSON lines of ``ObservedCall``; ``.gz`` read compressed)."""
    opener: Callable[..., Any] = gzip.open if str(path).endswith(".gz") else open
    decoder = msgspec.json.Decoder(ObservedCall)
    with opener(path, "rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]


def with_observations(
    groups: Mapping[str, Sequence[Record]], observed: Iterable[ObservedCall], *, config: str | None = None
) -> tuple[dict[str, list[Record]], int]:
    """``groups`` (copied) with each call's step given the ``observation`` an online run recorded for it, and how
    many calls got one. A rollout's recorded calls are matched in order by tool and arguments (a call the online
    run did not make, or made otherwise, gets none); of several runs, ``config``'s first repeat (None: the first
    run in the file)."""
    runs: dict[tuple[str, int], list[ObservedCall]] = {}
    first: tuple[str, int] | None = None
    for o in observed:
        if config is not None and o.config != config:
            continue
        first = first or (o.config, o.repeat)
        if (o.config, o.repeat) == first:
            runs.setdefault((o.task_id, o.rollout), []).append(o)
    out: dict[str, list[Record]] = {}
    matched = 0
    for task, records in groups.items():
        out[task] = []
        for r, record in enumerate(records):
            online = sorted(runs.get((task, r), []), key=lambda o: o.index)
            steps = [dict(s) for s in record.get("steps", ())]
            j = 0
            for s in _call_steps(steps):
                s.pop("observation", None)
                call = (s["tool"], s.get("args") or {})
                k = next((k for k in range(j, len(online)) if (online[k].tool, online[k].args) == call), None)
                if k is not None:
                    s["observation"], j = online[k].output, k + 1
                    matched += 1
            out[task].append({**record, "steps": steps})
    return out, matched


def _outputs(record: Record) -> list[str]:
    """Per call of ``record`` (as ``_calls`` lists them), what it printed as the runtime's ``last_output`` holds it
    (a trajectory the agent recorded tells the model an ``exit code N`` line first), or "" when the record does not
    say."""
    return [bounded_output(s.get("observation") or "") for s in _call_steps(record.get("steps", ()))]


def _call_steps(steps: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The steps that are calls, in order: up to the first that is none (the answer, or ``submit``), format errors
    left out (not replayed). ``_calls``, ``_outputs`` and ``with_observations`` index calls by this one list."""
    for s in steps:
        if not s.get("tool") or s["tool"] == "submit":
            return
        if s.get("kind") != "format_error":
            yield s


class OfflineReport(msgspec.Struct):
    """``calls`` decided; ``hideable_seconds``: the oracle's bound (cache hits aside); per source (and ``all``,
    the best candidate over every predictor): ``top1``/``top3`` exact hits, ``hidden_seconds`` (hideable time of
    the calls some launched guess matched: a guess is launched when its probability is at least ``threshold``),
    ``launched`` and ``wasted_seconds`` (the recorded durations of launched guesses that were wrong, as far as the
    group ever ran them; else the median tool time); and the calibration: per probability decile, guesses and
    hits. At most ``top`` guesses of each source are launched per call. ``hideable_after``: (``d``, the hideable
    time if every branch started ``d`` seconds after the previous observation rather than on it: ``min(tool, LLM -
    d)`` per call), for the ``delays`` asked; what a later launch point (the next turn's start, its first token, a
    fork's duration) costs."""

    calls: int = 0
    cache_hits: int = 0
    hideable_seconds: float = 0.0
    hideable_after: list[tuple[float, float]] = msgspec.field(default_factory=list)
    threshold: float = 0.3
    by_source: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    calibration: dict[str, list[tuple[float, int, int]]] = msgspec.field(default_factory=dict)

    def share(self, source: str = "all") -> float:
        """Of the hideable time, the share ``source``'s launched guesses hide."""
        hidden = self.by_source.get(source, {}).get("hidden_seconds", 0.0)
        return hidden / self.hideable_seconds if self.hideable_seconds else 0.0


def load_groups(path: str | os.PathLike[str], *, group_by: str = "task") -> dict[str, list[Record]]:
    """The trajectories of a trace file (``/work/shared/traces`` format), by task (or each its own group)."""
    opener: Callable[..., Any] = gzip.open if str(path).endswith(".gz") else open
    groups: dict[str, list[Record]] = defaultdict(list)
    with opener(path, "rb") as f:
        for i, line in enumerate(f):
            if line.strip():
                record = msgspec.json.decode(line)
                groups[record["task_id"] if group_by == "task" else f"{record['task_id']}:{i}"].append(record)
    return dict(groups)


def _calls(record: Record) -> list[tuple[CallKey, float, float]]:
    out = []
    for s in _call_steps(record.get("steps", ())):
        args = s.get("args") or {}
        key = CallKey(s["tool"], _BASH_VERSION, msgspec.json.encode(args, order="deterministic"))
        out.append((key, float(s.get("llm_seconds") or 0.0), float(s.get("tool_seconds") or 0.0)))
    return out


def evaluate(
    groups: Mapping[str, Sequence[Record]],
    make: Callable[[str], Callable[[], Sequence[Predictor]]],
    *,
    threshold: float = 0.3,
    top: int = 3,
    delays: Sequence[float] = (),
    reask: bool = False,
) -> OfflineReport:
    """Replay ``groups`` (task -> its rollouts' records); ``make(task)`` gives, per group, a factory of one
    rollout's predictors (sharing what the group shares: its ``SiblingTable``). ``reask``: a rollout's predictors
    are asked again whenever a sibling decides a call during its turn; a guess first made then hides only what is
    left of the turn (``min(tool, LLM - elapsed)``)."""
    report = OfflineReport(threshold=threshold)
    stats: dict[str, Counter[str]] = defaultdict(Counter)
    hidden: dict[str, float] = defaultdict(float)
    wasted: dict[str, float] = defaultdict(float)
    calib: dict[str, list[list[int]]] = defaultdict(lambda: [[0, 0] for _ in range(10)])
    delayed = dict.fromkeys(delays, 0.0)
    for task, records in groups.items():
        factory = make(task)
        rollouts = [_calls(r) for r in records]
        outputs = [_outputs(r) for r in records]
        durations: dict[CallKey, float] = {}
        for calls in rollouts:
            for key, _, tool in calls:
                durations.setdefault(key, tool)
        median_tool = sorted(durations.values())[len(durations) // 2] if durations else 0.0
        predictors = [factory() for _ in rollouts]
        # (time, order, kind, rollout, index): kind 0 = decide (the turn starts), 1 = observe (the call is made)
        events: list[tuple[float, int, int, int, int]] = []
        n = 0
        for r, calls in enumerate(rollouts):
            t = 0.0
            for i, (_, llm, tool) in enumerate(calls):
                events += [(t, n, 0, r, i), (t + llm, n + 1, 1, r, i)]
                n += 2
                t += llm + tool
        heapq.heapify(events)
        chains: list[list[bytes]] = [[chain_root(task)] for _ in rollouts]
        made: set[bytes] = set()  # (chain after the call) the cache could serve
        guesses: dict[tuple[int, int], list[tuple[Candidate, float]]] = {}  # open turns: (guess, when made)
        started: dict[tuple[int, int], float] = {}

        while events:
            now, _, kind, r, i = heapq.heappop(events)
            key, llm, tool = rollouts[r][i]
            ctx = _context(task, rollouts[r], chains[r], i, outputs[r])
            if kind == 0:
                guesses[r, i] = [(c, 0.0) for p in predictors[r] for c in p.predict(ctx)]
                started[r, i] = now
                continue
            after = extend_chain(chains[r][i], key)
            chains[r].append(after)
            cached = after in made
            made.add(after)
            report.calls += 1
            report.cache_hits += cached
            hideable = 0.0 if cached else min(llm, tool)
            report.hideable_seconds += hideable
            for d in delayed:
                delayed[d] += 0.0 if cached else min(tool, max(0.0, llm - d))
            cands = guesses.pop((r, i))
            started.pop((r, i))
            best: dict[str, dict[CallKey, float]] = defaultdict(dict)
            first: dict[tuple[str, CallKey], float] = {}  # when a guess was first made at the launch threshold
            for c, at in cands:
                ck = CallKey(c.name, _BASH_VERSION, msgspec.json.encode(c.arguments, order="deterministic"))
                for source in (c.source, "all"):
                    best[source][ck] = max(best[source].get(ck, 0.0), c.probability)
                    if c.probability >= threshold:
                        first[source, ck] = min(first.get((source, ck), at), at)
            for source, ranked in best.items():
                order = sorted(ranked.items(), key=lambda x: -x[1])
                s = stats[source]
                s["guessed"] += 1
                s["top1"] += order[0][0] == key
                s["top3"] += any(k == key for k, _ in order[:3])
                for k, p in order[:top]:
                    calib[source][min(9, int(p * 10))][0] += 1
                    calib[source][min(9, int(p * 10))][1] += k == key
                    if p >= threshold and not cached:
                        s["launched"] += 1
                        if k == key:
                            hidden[source] += min(hideable, max(0.0, llm - first.get((source, k), 0.0)))
                            s["committed"] += 1
                        else:
                            wasted[source] += durations.get(k, median_tool)
            for predictor in predictors[r]:
                predictor.observe(ctx, key)
            if reask:  # the siblings still in their turn see what this rollout just decided
                for (r2, i2), open_guesses in guesses.items():
                    ctx2 = _context(task, rollouts[r2], chains[r2], i2, outputs[r2])
                    open_guesses += [(c, now - started[r2, i2]) for p in predictors[r2] for c in p.predict(ctx2)]
    for source, s in stats.items():
        report.by_source[source] = {
            **{k: float(v) for k, v in s.items()},
            "top1_rate": round(s["top1"] / report.calls, 4) if report.calls else 0.0,
            "hidden_seconds": round(hidden[source], 2),
            "wasted_seconds": round(wasted[source], 2),
        }
        report.calibration[source] = [(b / 10, n, h) for b, (n, h) in enumerate(calib[source]) if n]
    report.hideable_seconds = round(report.hideable_seconds, 2)
    report.hideable_after = [(d, round(v, 2)) for d, v in delayed.items()]
    return report


def _context(
    task: str,
    calls: Sequence[tuple[CallKey, float, float]],
    chain: Sequence[bytes],
    i: int,
    outputs: Sequence[str] = (),
) -> PredictionContext:
    """What the predictors see at turn ``i`` of a rollout: its calls before it, their chain key and what the
    previous call printed (``outputs``: per call, "" when unknown)."""
    history = tuple(k for k, _, _ in calls[:i])
    last = outputs[i - 1] if 0 < i <= len(outputs) else ""
    return PredictionContext(history=history, chain=chain[i], turn=i, position=0, group=task, last_output=last)


def leave_task_out(groups: Mapping[str, Sequence[Record]]) -> Iterable[tuple[str, list[Record]]]:
    """For each task, the records of every other task (what a table may be trained on to be evaluated on it)."""
    for task in groups:
        yield task, [r for t, rs in groups.items() if t != task for r in rs]


def calibration(report: OfflineReport, *, prior: float = 2.0) -> dict[str, list[float]]:
    """Per source, per decile of stated probability, the observed hit rate (shrunk towards the decile's middle by
    ``prior`` guesses' worth, then made non-decreasing: pool adjacent violators, weighted by guesses)."""
    out: dict[str, list[float]] = {}
    for source, bins in report.calibration.items():
        if source == "all":
            continue
        n = [0.0] * 10
        h = [0.0] * 10
        for lo, guesses, hits in bins:
            n[round(lo * 10)] = guesses
            h[round(lo * 10)] = hits
        blocks: list[tuple[float, float, int]] = []  # (rate, weight, deciles)
        for b in range(10):
            block = ((h[b] + prior * (b + 0.5) / 10) / (n[b] + prior), n[b] + prior, 1)
            while blocks and blocks[-1][0] > block[0]:
                r1, w1, c1 = blocks.pop()
                block = ((r1 * w1 + block[0] * block[1]) / (w1 + block[1]), w1 + block[1], c1 + block[2])
            blocks.append(block)
        out[source] = [round(r, 4) for r, _, c in blocks for _ in range(c)]
    return out
