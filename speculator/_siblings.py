"""What other rollouts of the group did next from the same history: the shared ``SiblingTable`` and
the ``SiblingPredictor`` that reads it."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence

import xxhash

from bunshin_async.speculation import CallKey, Candidate, GroupSignal, PredictionContext

__all__ = [
    "SiblingPredictor",
    "SiblingTable",
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
    still repeat pairs such as a build then its benchmark; ``head``: the same by the previous call's tool and first
    line, for multi-line commands), after each call that printed the same thing (``seen``:
    previous call and ``_output_digest`` of its output -> calls: the same test run, passing, was followed by
    the build), or ended the same way (``similar``: previous call and ``_output_shape`` of its output), and the
    argument templates the observation predictor learned (``templates``)."""

    def __init__(self) -> None:
        self.next: dict[bytes, Counter[CallKey]] = defaultdict(Counter)
        self.after: dict[CallKey | None, Counter[CallKey]] = defaultdict(Counter)
        self.seen: dict[tuple[CallKey | None, bytes], Counter[CallKey]] = defaultdict(Counter)
        self.similar: dict[tuple[CallKey | None, bytes], Counter[CallKey]] = defaultdict(Counter)
        self.head: dict[tuple[str, str], Counter[CallKey]] = defaultdict(Counter)
        self.templates: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
        #: Every call the group made, by signature (``tool:program``; kept by ``SignaturePredictor``): which
        #: concrete call a predicted signature most likely is, for a rollout that never made one.
        self.by_signature: dict[str, Counter[CallKey]] = defaultdict(Counter)
        #: Told when a rollout of the group decides a call (``Speculation.signal``): the others plan again.
        self.signal = GroupSignal()

    def add(self, chain: bytes, call: CallKey, previous: CallKey | None = None, output: str | None = None) -> None:
        self.next[chain][call] += 1
        self.after[previous][call] += 1
        if previous is not None and (head := _head(previous)) is not None:
            self.head[head][call] += 1
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
    another name), else after the same previous call whatever it printed (``after_confidence``, doubled for a call
    two siblings made there), else after a previous call that began with the same line (``head_confidence``: a
    heredoc that wrote the same file, with other contents, is followed by the same run of it).
    The observation is the context's ``last_output``, used for a message's first call (then it is surely the
    previous call's); an empty one (``mkdir``, a heredoc) says nothing a sibling's did not.
    The history-free odds are what such guesses scored on timed terminal-benchmark traces, whose rollouts start
    together (``scripts/eval_predictors.py``, leave-task-out): a sibling's next call after the same previous call
    was the next call one time in six (two siblings' call: one in two), after a command with the same first line two
    in five."""

    name = "siblings"

    def __init__(
        self,
        table: SiblingTable | None = None,
        *,
        confidence: float = 0.9,
        seen_confidence: float = 0.8,
        similar_confidence: float = 0.7,
        after_confidence: float = 0.2,
        head_confidence: float = 0.4,
        top: int = 3,
    ) -> None:
        self.table = table if table is not None else SiblingTable()
        self.confidence = confidence
        self.seen_confidence = seen_confidence
        self.similar_confidence = similar_confidence
        self.after_confidence = after_confidence
        self.head_confidence = head_confidence
        self.top = top

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        seen, confidence, agree = self.table.next.get(ctx.chain), self.confidence, 1
        if not seen and ctx.history:
            previous = ctx.history[-1]
            output = _observation(ctx)
            if output:
                seen, confidence = self.table.seen.get((previous, _output_digest(output))), self.seen_confidence
                if not seen:
                    seen = self.table.similar.get((previous, _output_shape(output)))
                    confidence = self.similar_confidence
            if not seen:
                # a call two siblings made after this one is twice as likely as one a single sibling made
                seen, confidence, agree = self.table.after.get(previous), self.after_confidence, 2
            if not seen and (head := _head(previous)) is not None:
                seen, confidence, agree = self.table.head.get(head), self.head_confidence, 1
        if not seen:
            return []
        total = sum(seen.values())
        return [
            Candidate(
                name=k.name,
                arguments=k.arguments(),
                probability=min(1.0, confidence * min(n, agree) * n / total),
                source=self.name,
            )
            for k, n in seen.most_common(self.top)
        ]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.table.add(ctx.chain, call, ctx.history[-1] if ctx.history else None, _observation(ctx))


def _head(call: CallKey) -> tuple[str, str] | None:
    """The tool and first line of a multi-line command that writes a named file (``cat <<'EOF' > run.py``): the
    part that says what it does; other first lines (``python3 -c "``) say nothing."""
    command = call.arguments().get("command")
    if not isinstance(command, str) or "\n" not in command.strip():
        return None
    first = command.strip().split("\n", 1)[0].strip()
    return (call.name, first) if _WRITES.search(first) else None


# A first line that writes a file it names: a redirection into it, or tee's argument.
_WRITES = re.compile(r"(?<![\d&])>{1,2}\s*['\"]?[\w.~+/-]*\w|\btee\s+(-a\s+)?['\"]?[\w.~+/-]*\w")


def _observation(ctx: PredictionContext) -> str | None:
    """What the previous call printed, when ``ctx.last_output`` is surely that: for a message's first call (the
    previous turn's calls have all finished; later calls of a message may be predicted while earlier ones run)."""
    return ctx.last_output if ctx.history and ctx.position == 0 else None
