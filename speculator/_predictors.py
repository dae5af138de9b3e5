"""Predictors of the next tool call. Each implements ``bunshin_async.speculation.Predictor``: ``predict(ctx)``
returns ranked ``Candidate``s with probabilities, ``observe(ctx, call)`` learns from the call really made."""

from __future__ import annotations

import gzip
import os
import re
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec
import xxhash

from bunshin_async import InvalidValue
from bunshin_async.speculation import CallKey, Candidate, PredictionContext

from ._signature import key_signature, signature

__all__ = [
    "DocsPredictor",
    "HistoryPredictor",
    "NgramModel",
    "ObservationPredictor",
    "OraclePredictor",
    "RecentPredictor",
    "Rule",
    "RulePredictor",
    "SiblingPredictor",
    "SiblingTable",
    "SignaturePredictor",
]


# What differs between two runs of one command that saw the same thing: numbers (times, sizes, pids, addresses).
_VOLATILE = re.compile(rb"\d+")


def _output_digest(output: str) -> bytes:
    """A digest of what a call printed, numbers masked: two runs that printed the same thing but for timings (``Ran
    5 tests in 0.003s``), sizes or pids have the same digest."""
    return xxhash.xxh3_64(_VOLATILE.sub(b"0", output.encode(errors="replace"))).digest()


def _output_shape(output: str) -> bytes:
    """A coarser digest than ``_output_digest``: the last non-empty line (where a run says how it ended: the error,
    the summary), numbers and quoted names masked. Two observations of one outcome (``No module named 'x'`` and
    ``... 'y'``, ``3 failed`` and ``1 failed``) share it."""
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
    text = _QUOTED.sub("''", last).encode(errors="replace")
    return xxhash.xxh3_64(_VOLATILE.sub(b"0", text)).digest()


_QUOTED = re.compile(r"'[^'\n]{0,200}'|\"[^\"\n]{0,200}\"")


class SiblingTable:
    """What rollouts of one group did next, in memory, shared by every rollout of the group (pass one table to each
    rollout's ``SiblingPredictor`` and ``ObservationPredictor``): from each whole history (``next``: chain key ->
    calls), after each call whatever came before it (``after``: previous call -> calls; rollouts that diverged
    still repeat pairs such as a build then its benchmark), after each call that printed the same thing (``seen``:
    previous call and ``_output_digest`` of its output -> calls: the same test run, passing, was followed by
    the build), or ended the same way (``similar``: previous call and ``_output_shape`` of its output), and the
    argument templates the observation predictor learned (``templates``)."""

    def __init__(self) -> None:
        self.next: dict[bytes, Counter[CallKey]] = defaultdict(Counter)
        self.after: dict[CallKey | None, Counter[CallKey]] = defaultdict(Counter)
        self.seen: dict[tuple[CallKey | None, bytes], Counter[CallKey]] = defaultdict(Counter)
        self.similar: dict[tuple[CallKey | None, bytes], Counter[CallKey]] = defaultdict(Counter)
        self.templates: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
        #: Every call the group made, by signature (``tool:program``; kept by ``SignaturePredictor``): which
        #: concrete call a predicted signature most likely is, for a rollout that never made one.
        self.by_signature: dict[str, Counter[CallKey]] = defaultdict(Counter)

    def add(self, chain: bytes, call: CallKey, previous: CallKey | None = None, output: str | None = None) -> None:
        self.next[chain][call] += 1
        self.after[previous][call] += 1
        if output is not None:
            self.seen[previous, _output_digest(output)][call] += 1
            self.similar[previous, _output_shape(output)][call] += 1

    def __len__(self) -> int:
        return len(self.next)


class SiblingPredictor:
    """The calls sibling rollouts made next from the same history (same chain key), with their frequencies as
    probabilities (``confidence`` scales them: siblings diverge even from equal prefixes); for a history no sibling
    had, what siblings did after the same previous call when it printed the same thing (``seen_confidence``: agents
    answer equal observations alike), else when it ended the same way (``similar_confidence``: the same error about
    another name), else after the same previous call whatever it printed (``after_confidence``).
    The observation is the context's ``last_output``, used for a message's first call (then it is surely the
    previous call's)."""

    name = "siblings"

    def __init__(
        self,
        table: SiblingTable | None = None,
        *,
        confidence: float = 0.9,
        seen_confidence: float = 0.8,
        similar_confidence: float = 0.7,
        after_confidence: float = 0.6,
        top: int = 3,
    ) -> None:
        self.table = table if table is not None else SiblingTable()
        self.confidence = confidence
        self.seen_confidence = seen_confidence
        self.similar_confidence = similar_confidence
        self.after_confidence = after_confidence
        self.top = top

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        seen, confidence = self.table.next.get(ctx.chain), self.confidence
        if not seen and ctx.history:
            previous = ctx.history[-1]
            output = _observation(ctx)
            if output is not None:
                seen, confidence = self.table.seen.get((previous, _output_digest(output))), self.seen_confidence
                if not seen:
                    seen = self.table.similar.get((previous, _output_shape(output)))
                    confidence = self.similar_confidence
            if not seen:
                seen, confidence = self.table.after.get(previous), self.after_confidence
        if not seen:
            return []
        total = sum(seen.values())
        return [
            Candidate(name=k.name, arguments=k.arguments(), probability=confidence * n / total, source=self.name)
            for k, n in seen.most_common(self.top)
        ]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.table.add(ctx.chain, call, ctx.history[-1] if ctx.history else None, _observation(ctx))


def _observation(ctx: PredictionContext) -> str | None:
    """What the previous call printed, when ``ctx.last_output`` is surely that: for a message's first call (the
    previous turn's calls have all finished; later calls of a message may be predicted while earlier ones run)."""
    return ctx.last_output if ctx.history and ctx.position == 0 else None


# What an observation names that the next call is likely to take as an argument: the module of an import error,
# the program a shell could not find.
_ENTITIES = {
    "module": re.compile(r"No module named '([A-Za-z_][\w]*)(?:\.[\w.]*)?'"),
    "program": re.compile(r"(?:^|\n)(?:\S+: )?(?:line \d+: )?([\w.+-]+): command not found"),
}
_HOLE = "\x00{}\x00"


def _entities(output: str) -> dict[str, str]:
    found = {}
    for kind, pattern in _ENTITIES.items():
        hits = pattern.findall(output)
        if hits:
            found[kind] = hits[-1]  # the last one printed is the one the run stopped on
    return found


class ObservationPredictor:
    """Argument filling from the last observation: when the latest call's output names a module an import failed
    on (``ModuleNotFoundError: No module named 'x'``) or a program the shell did not find, predict the calls that
    followed such an observation before (in this rollout first, then in its siblings: the ``SiblingTable``'s
    templates) with the new name filled in (``pip install ... ./vendor/x``). A template is a one-line call whose
    arguments contained an entity one of the ``recall`` observations before it named (agents often read a file
    between an import error and the install), with the entity cut out."""

    name = "observation"

    def __init__(
        self, table: SiblingTable | None = None, *, own: float = 0.85, siblings: float = 0.7, recall: int = 3
    ) -> None:
        self.table = table if table is not None else SiblingTable()
        self.own_confidence = own
        self.sibling_confidence = siblings
        self.own: dict[str, list[tuple[str, str]]] = defaultdict(list)
        self._recent: deque[dict[str, str]] = deque(maxlen=recall)  # the entities of the latest observations
        self._last_output: str | None = None

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        if ctx.position != len(ctx.decided) or not ctx.last_output:
            return []
        filled: dict[tuple[str, str], float] = {}
        for kind, entity in _entities(ctx.last_output).items():
            scored: dict[tuple[str, str], float] = {}
            for rank, template in enumerate(reversed(self.own.get(kind, [])[-3:])):
                scored[template] = max(scored.get(template, 0.0), self.own_confidence * 0.5**rank)
            counts = self.table.templates.get(kind)
            if counts:
                total = sum(counts.values())
                for template, n in counts.most_common(3):
                    scored[template] = max(scored.get(template, 0.0), self.sibling_confidence * n / total)
            for (name, args), p in scored.items():
                key = (name, args.replace(_HOLE.format(kind), entity))
                filled[key] = max(filled.get(key, 0.0), p)
        out = []
        for (name, args), p in sorted(filled.items(), key=lambda x: -x[1]):
            try:
                arguments = msgspec.json.decode(args)
            except msgspec.DecodeError:
                continue
            if isinstance(arguments, dict):
                out.append(Candidate(name=name, arguments=arguments, probability=p, source=self.name))
        return out[:3]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        if not ctx.last_output or ctx.position != len(ctx.decided):
            return
        if ctx.last_output != self._last_output:  # several calls of one message follow the same observation
            self._last_output = ctx.last_output
            self._recent.append(_entities(ctx.last_output))
        text = call.args.decode()
        if "\\n" in text:  # a script or a heredoc names the entity in passing: not an argument to fill in
            return
        # (kind, entity) pairs, each once, the latest observation's first
        named = dict.fromkeys(pair for entities in reversed(self._recent) for pair in entities.items())
        for kind, entity in named:
            if len(entity) < 2 or entity not in text:
                continue
            template = (call.name, re.sub(rf"(?<![\w-]){re.escape(entity)}(?![\w-])", _HOLE.format(kind), text))
            if template[1] == text:
                continue
            self.own[kind].append(template)
            self.table.templates[kind][template] += 1


# Shell commands an observation quotes (a README's `make test`, a hint's `pip install x`): inline code spans and
# the lines of fenced shell blocks, ``$ `` prompts stripped, whose first word is a path or a known program.
_SPAN = re.compile(r"`([^`\n]{3,300})`")
_FENCE = re.compile(r"```(?:bash|sh|shell|console|text)?[ \t]*\n(.*?)```", re.S)
_COMMAND = re.compile(
    r"^(?:[\w.-]*/[\w./-]+|python3?|pip3?|pytest|make|npm|npx|yarn|pnpm|cargo|go|uv|poetry|tox|node|bash|sh|"
    r"apt-get|apt|conda|gem|mvn|gradle|ctest|cmake|git)(?:\s|$)"
)
# A placeholder in a quoted command: ``<pkg>``, ``{module}``, or a capitalised word such as ``NAME`` (not part of
# a word, an option or an assignment).
_PLACEHOLDER = re.compile(r"<[A-Za-z][\w-]*>|\{[A-Za-z][\w-]*\}|(?<![\w.=-])[A-Z][A-Z0-9_]{2,}(?![\w=])")
_SCAN_LIMIT = 256 << 10  # characters of one observation scanned for commands


def quoted_commands(text: str) -> list[str]:
    """The shell commands ``text`` quotes (``_SPAN``, ``_FENCE``, ``_COMMAND``), in order."""
    text = text[:_SCAN_LIMIT]
    found = [m.strip() for m in _SPAN.findall(text)]
    for block in _FENCE.findall(text):
        found += [line.strip().removeprefix("$ ").strip() for line in block.splitlines()]
    return [c for c in found if _COMMAND.match(c)]


class DocsPredictor:
    """Commands the rollout's observations quoted (a README's install line, an error's ``try: pip install x``),
    which agents copy: when the latest observation names an entity (the module an import failed on, a program the
    shell did not find), each quoted command with a placeholder (``NAME``, ``<pkg>``, ``{module}``) filled with
    it, or that names it already, the latest read first. The call is made with the tool (taking a ``command``)
    the rollout used last. One per rollout: it keeps the commands its rollout read (the latest ``keep``)."""

    name = "docs"

    def __init__(self, *, confidence: float = 0.5, top: int = 2, keep: int = 64) -> None:
        self.confidence = confidence
        self.top = top
        self.keep = keep
        self.commands: dict[str, None] = {}  # an ordered set, the latest read last
        self._read: set[bytes] = set()

    def _scan(self, output: str) -> None:
        digest = xxhash.xxh3_64(output[:_SCAN_LIMIT].encode(errors="replace")).digest()
        if digest in self._read:
            return
        self._read.add(digest)
        for command in quoted_commands(output):
            self.commands.pop(command, None)
            self.commands[command] = None
        while len(self.commands) > self.keep:
            del self.commands[next(iter(self.commands))]

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        if not ctx.last_output or ctx.position != len(ctx.decided):
            return []
        self._scan(ctx.last_output)
        entities = [e for e in _entities(ctx.last_output).values() if len(e) >= 2]
        if not entities:
            return []
        tool = next((c.name for c in reversed(ctx.history) if isinstance(c.arguments().get("command"), str)), None)
        if tool is None:
            return []
        out: list[Candidate] = []
        seen: set[str] = set()
        for command in reversed(self.commands):
            hole = _PLACEHOLDER.search(command)
            for entity in entities:
                if hole is not None:
                    filled = command[: hole.start()] + entity + command[hole.end() :]
                elif re.search(rf"(?<![\w-]){re.escape(entity)}(?![\w-])", command):
                    filled = command
                else:
                    continue
                if filled in seen or _PLACEHOLDER.search(filled):
                    continue
                seen.add(filled)
                p = self.confidence * 0.5 ** len(out)
                out.append(Candidate(name=tool, arguments={"command": filled}, probability=p, source=self.name))
                if len(out) >= self.top:
                    return out
        return out

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        if ctx.last_output:
            self._scan(ctx.last_output)


# Programs whose runs a rollout repeats after changing something (tests, scripts, builds).
_RUNS = re.compile(r"^bash:(python( -m \S+| script)?|pytest|make|npm|yarn|cargo|go|node|mvn|gradle|ctest|tox)$")
_EDITS = re.compile(r"^bash:(sed|cat >|tee|echo >|printf >|patch|git apply|python -c >)$|^(write_file|str_replace)")
# Package managers: ``<one of these> ... install|add ...`` changes the environment a run failed in.
_MANAGERS = re.compile(r"^bash:(pip\d*|python -m pip|uv|apt|apt-get|npm|yarn|pnpm|conda|mamba|gem|cargo|go|poetry)$")
_INSTALL = re.compile(r"(?<![\w-])(install|add)(?![\w-])")


def _installs(call: CallKey, sig: str) -> bool:
    return bool(_MANAGERS.match(sig)) and bool(_INSTALL.search(call.args.decode(errors="replace")))


class RecentPredictor:
    """The rollout's own recent runs: after an edit (``sed -i``, a heredoc, ``write_file``) or an install (``pip
    install``, ``npm add``), the runs it made before (the last test command first), which agents repeat to check
    the change. Installs are never the runs repeated."""

    name = "recent"

    def __init__(self, *, confidence: float = 0.6, top: int = 2) -> None:
        self.confidence = confidence
        self.top = top

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        if not ctx.history:
            return []
        last = ctx.history[-1]
        sig = key_signature(last)
        if not _EDITS.match(sig) and not _installs(last, sig):
            return []
        out: list[Candidate] = []
        seen: set[CallKey] = set()
        for call in reversed(ctx.history[:-1]):
            sig = key_signature(call)
            if call in seen or not _RUNS.match(sig) or _installs(call, sig):
                continue
            seen.add(call)
            p = self.confidence * (0.4 ** len(out))
            out.append(Candidate(name=call.name, arguments=call.arguments(), probability=p, source=self.name))
            if len(out) >= self.top:
                break
        return out

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass


class NgramModel:
    """An n-gram model over call signatures (``tool:program``) with back-off, plus, per signature, how often the
    next call with that signature repeats the rollout's latest one exactly (re-running a test after an edit)."""

    def __init__(self, order: int = 3) -> None:
        self.order = order
        self.counts: dict[tuple[str, ...], Counter[str]] = defaultdict(Counter)
        self.repeat: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()
        #: Observed hit rate per decile of a predictor's stated probability (``calibrate``): index ``int(10 p)``.
        self.calibration: dict[str, list[float]] = {}

    def calibrated(self, source: str, probability: float) -> float:
        """``probability`` as ``source``'s guesses with that stated probability turned out, where measured
        (``calibrate``); unchanged otherwise."""
        table = self.calibration.get(source)
        if not table:
            return probability
        return table[min(len(table) - 1, int(probability * len(table)))]

    def add_sequence(self, calls: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
        sigs: list[str] = []
        latest: dict[str, bytes] = {}
        for name, args in calls:
            sig = signature(name, args)
            for n in range(self.order):
                if n <= len(sigs):
                    ctx = tuple(sigs[len(sigs) - n :]) if n else ()
                    self.counts[ctx][sig] += 1
            exact = msgspec.json.encode(args, order="deterministic")
            if sig in latest:
                self.seen[sig] += 1
                self.repeat[sig] += latest[sig] == exact
            latest[sig] = exact
            sigs.append(sig)

    def next_signatures(self, history: Sequence[str], top: int = 5) -> list[tuple[str, float]]:
        """P(next signature | the last ``order-1`` signatures), backing off to shorter contexts."""
        for n in range(min(self.order - 1, len(history)), -1, -1):
            ctx = tuple(history[len(history) - n :]) if n else ()
            counter = self.counts.get(ctx)
            if counter:
                total = sum(counter.values())
                return [(s, c / total) for s, c in counter.most_common(top)]
        return []

    def repeat_probability(self, sig: str) -> float:
        return (self.repeat[sig] + 0.5) / (self.seen[sig] + 2.0)

    def to_table(self, *, min_count: int = 2, top: int = 12) -> bytes:
        """A compact table of what the model learned (gzipped JSON): per context, its ``top`` next signatures seen
        at least ``min_count`` times, and the repeat statistics. ``from_table`` reads it back."""
        table = _NgramTable(
            order=self.order,
            contexts=[
                (list(ctx), {s: c for s, c in counter.most_common(top) if c >= min_count})
                for ctx, counter in sorted(self.counts.items())
                if sum(counter.values()) >= min_count and counter.most_common(1)[0][1] >= min_count
            ],
            repeat=dict(self.repeat),
            seen={s: n for s, n in self.seen.items() if n >= min_count},
            calibration=self.calibration,
        )
        return gzip.compress(_table_encoder.encode(table), mtime=0)

    @classmethod
    def from_table(cls, data: bytes) -> NgramModel:
        """The model ``to_table`` wrote. Raises ``ValueError`` on anything else."""
        try:
            table = _table_decoder.decode(gzip.decompress(data))
        except (OSError, EOFError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidValue(f"not an n-gram table: {exc}", argument="path") from None
        model = cls(table.order)
        for ctx, nexts in table.contexts:
            model.counts[tuple(ctx)].update(nexts)
        model.repeat.update({s: n for s, n in table.repeat.items() if s in table.seen})
        model.seen.update(table.seen)
        model.calibration = {k: list(v) for k, v in table.calibration.items()}
        return model

    def add_record(self, record: Mapping[str, Any]) -> None:
        """Learn one trajectory record (``/work/shared/traces`` format): its tool calls, format errors and the final
        submission left out."""
        self.add_sequence(
            (s["tool"], s.get("args") or {})
            for s in record.get("steps", ())
            if s.get("tool") and s.get("kind") != "format_error" and s.get("tool") != "submit"
        )

    def train_file(self, path: str | os.PathLike[str], limit: int | None = None) -> int:
        """Train on a JSONL(.gz) trace file (``/work/shared/traces`` format or ``Trajectory`` records). Blocking;
        returns the number of trajectories read."""
        opener: Callable[..., Any] = gzip.open if str(path).endswith(".gz") else open
        n = 0
        with opener(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                self.add_record(msgspec.json.decode(line))
                n += 1
                if limit is not None and n >= limit:
                    break
        return n


class _NgramTable(msgspec.Struct):
    order: int
    contexts: list[tuple[list[str], dict[str, int]]]
    repeat: dict[str, int]
    seen: dict[str, int]
    calibration: dict[str, list[float]] = msgspec.field(default_factory=dict)


_table_encoder = msgspec.json.Encoder(order="deterministic")
_table_decoder = msgspec.json.Decoder(_NgramTable)


class HistoryPredictor:
    """Predicts from an ``NgramModel``: the likely next signatures, each made concrete as the rollout's latest call
    with that signature (probability: P(signature) x P(exact repeat)). Learns online from observed calls."""

    name = "history"

    def __init__(self, model: NgramModel | None = None, *, top: int = 3, learn: bool = True) -> None:
        self.model = model if model is not None else NgramModel()
        self.top = top
        self.learn = learn

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        calls = [*ctx.history]
        sigs = [key_signature(c) for c in calls]
        latest: dict[str, CallKey] = {}
        for sig, call in zip(sigs, calls, strict=True):
            latest[sig] = call
        out: list[Candidate] = []
        for sig, p in self.model.next_signatures(sigs, top=8):
            prev = latest.get(sig)
            if prev is None:
                continue
            prob = self.model.calibrated(self.name, p * self.model.repeat_probability(sig))
            out.append(Candidate(name=prev.name, arguments=prev.arguments(), probability=prob, source=self.name))
            if len(out) >= self.top:
                break
        return out

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        if not self.learn:
            return
        sig = key_signature(call)
        history = [key_signature(c) for c in ctx.history[len(ctx.history) - (self.model.order - 1) :]]
        for n in range(self.model.order):
            if n <= len(history):
                key = tuple(history[len(history) - n :]) if n else ()
                self.model.counts[key][sig] += 1


class SignaturePredictor:
    """Calls that recur by program signature, across tasks: an ``NgramModel`` (learned from trajectory corpora)
    says which signatures come next (after an edit, the test run; after a failed import, an install), and the group
    says which concrete call each one is: the rollout's own latest call with that signature (probability: P(next
    signature) x P(it repeats exactly)), else the calls siblings made with it (P(next signature) x P(not a repeat)
    x their share of the group's calls with that signature). Probabilities go through the model's calibration for
    this source (``NgramModel.calibrate``: what such guesses scored on held-out traces). Where the same call is
    both, it keeps the larger."""

    name = "signatures"

    def __init__(self, model: NgramModel, table: SiblingTable | None = None, *, top: int = 3) -> None:
        self.model = model
        self.table = table if table is not None else SiblingTable()
        self.top = top

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        history = [*ctx.history, *ctx.decided[: ctx.position]]
        sigs = [key_signature(c) for c in history]
        latest: dict[str, CallKey] = {}
        for sig, call in zip(sigs, history, strict=True):
            latest[sig] = call
        scored: dict[CallKey, float] = {}
        for sig, p in self.model.next_signatures(sigs, top=8):
            repeat = self.model.repeat_probability(sig)
            own = latest.get(sig)
            if own is not None:
                scored[own] = max(scored.get(own, 0.0), p * repeat)
            group = self.table.by_signature.get(sig)
            if group:
                fresh = 1.0 - repeat if own is not None else 1.0
                total = sum(group.values())
                for call, n in group.most_common(self.top):
                    scored[call] = max(scored.get(call, 0.0), p * fresh * n / total)
        best = sorted(scored.items(), key=lambda x: -x[1])[: self.top]
        return [
            Candidate(
                name=k.name,
                arguments=k.arguments(),
                probability=self.model.calibrated(self.name, p),
                source=self.name,
            )
            for k, p in best
        ]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.table.by_signature[key_signature(call)][call] += 1


class Rule(msgspec.Struct, frozen=True, kw_only=True):
    """After a call whose ``after_tool`` matches and whose ``after`` regex matches its command (or its JSON
    arguments), predict ``then`` (a tool name and arguments) with ``probability``. ``after=None`` with
    ``at_start=True`` fires for the first call of a rollout. ``expected_seconds`` tells the policy how long the
    predicted call runs (unknown calls otherwise get the policy's prior)."""

    then_tool: str
    then_args: dict[str, Any]
    probability: float = 0.9
    after: str | None = None
    after_tool: str | None = None
    at_start: bool = False
    expected_seconds: float | None = None


class RulePredictor:
    """User rules (``Rule``), or any callables ``ctx -> candidates``."""

    name = "rules"

    def __init__(self, rules: Iterable[Rule | Callable[[PredictionContext], Sequence[Candidate]]] = ()) -> None:
        self.rules = list(rules)
        self._compiled: dict[str, re.Pattern[str]] = {}

    def _fires(self, rule: Rule, ctx: PredictionContext) -> bool:
        if not ctx.history:
            return rule.at_start
        last = ctx.history[-1]
        if rule.after_tool is not None and last.name != rule.after_tool:
            return False
        if rule.after is None:
            return not rule.at_start
        pattern = self._compiled.setdefault(rule.after, re.compile(rule.after))
        args = last.arguments()
        text = args.get("command") if isinstance(args.get("command"), str) else last.args.decode()
        return pattern.search(str(text)) is not None

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        out: list[Candidate] = []
        for rule in self.rules:
            if isinstance(rule, Rule):
                if self._fires(rule, ctx):
                    out.append(
                        Candidate(
                            name=rule.then_tool,
                            arguments=dict(rule.then_args),
                            probability=rule.probability,
                            source=self.name,
                            expected_seconds=rule.expected_seconds,
                        )
                    )
            else:
                out.extend(rule(ctx))
        return out

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass


class OraclePredictor:
    """Told the rollout's true calls (``script``: tool name and arguments, in order): predicts the next one with
    probability 1 (after a chain of speculated calls, the one after them). The experiment's ``oracle``
    configuration uses it to bound what speculation can buy."""

    name = "oracle"

    def __init__(self, script: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        self.script = [(name, dict(args)) for name, args in script]

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        n = len(ctx.history)
        if n >= len(self.script):
            return []
        name, args = self.script[n]
        return [Candidate(name=name, arguments=args, probability=1.0, source=self.name)]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass
