"""The rollout's own recent runs, repeated after an edit (``RecentPredictor``)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from bunshin_async.speculation import CallKey, Candidate, PredictionContext
from bunshin_async.tools import Effect, classify_command

from ._signature import installer, key_signature

__all__ = [
    "RecentPredictor",
]


# Programs whose runs a rollout repeats after changing something (tests, scripts, builds).
_RUNS = re.compile(r"^bash:(python( -m \S+| script)?|pytest|make|npm|yarn|cargo|go|node|mvn|gradle|ctest|tox)$")
_EDITS = re.compile(r"^bash:(sed|cat >|tee|echo >|printf >|patch|git apply|python -c >)$|^(write_file|str_replace)")
# A heredoc or redirect writes a whole file: often a new one no earlier run used.
_WRITES = re.compile(r"^bash:(cat >|tee|echo >|printf >)$|^write_file")
# A file a command names: a word with an extension (``a.py``, ``src/x.test.js``, ``'conf.yaml'``).
_FILE = re.compile(r"[\w.~+/-]*[\w-]\.[A-Za-z]\w{0,7}(?![\w/])")


def _command(call: CallKey) -> str | None:
    command = call.arguments().get("command")
    return command if isinstance(command, str) else None


def _installs(call: CallKey) -> bool:
    """An install changes the environment a run failed in (``pip install``, ``npm add``)."""
    command = _command(call)
    return command is not None and installer(command) is not None


def _reads(call: CallKey) -> bool:
    """A shell command that only reads (``cat``, ``nl -ba``, ``ls``): what an agent looks at between a change
    and the run that checks it."""
    command = _command(call)
    return command is not None and classify_command(command).effect is Effect.READ


def _edited(call: CallKey) -> set[str]:
    """The base names of the files an edit's first line names (its target among them). Word by word, words longer
    than a file name's 255 bytes left out: ``_FILE`` backtracks over a run of path characters, quadratic in its
    length (a 64 KB word took ~50 s on the event loop)."""
    text = _command(call)
    first = (text if text is not None else call.args.decode(errors="replace")).split("\n", 1)[0]
    return {m.group(0).rsplit("/", 1)[-1] for word in first.split() if len(word) <= 255 for m in _FILE.finditer(word)}


def _names(command: str, files: set[str]) -> bool:
    return any(re.search(rf"(?<![\w.-]){re.escape(f)}(?![\w-])", command) for f in files)


class RecentPredictor:
    """The rollout's own recent runs: after an edit (``sed -i``, a heredoc, ``write_file``) or an install (``pip
    install``, ``npm add``), possibly followed by up to ``reads`` reads (``nl -ba`` of what was changed), the runs
    it made before the change (the last first), which agents repeat to check it. Installs are never the runs
    repeated.

    Its odds are what such guesses scored on timed terminal-benchmark traces (``scripts/eval_predictors.py``): a
    run that names the file just edited is repeated about half the time (``named``), the last run after an install
    about as often (``installed``), a run after an in-place edit of another file one time in four (``confidence``),
    a run after a heredoc that rewrote a file the rollout named before half the time (``rewritten``), after one that
    wrote a new file almost never (``written``: the new file is run instead, ``WrittenPredictor``); each older run
    is ``decay`` as likely (a run naming the file, only than the runs naming it after it)."""

    name = "recent"

    def __init__(
        self,
        *,
        confidence: float = 0.25,
        named: float = 0.55,
        installed: float = 0.45,
        written: float = 0.01,
        rewritten: float = 0.5,
        reads: int = 3,
        decay: float = 0.4,
        top: int = 2,
    ) -> None:
        self.confidence, self.named, self.installed = confidence, named, installed
        self.written, self.rewritten = written, rewritten
        self.reads = reads
        self.decay = decay
        self.top = top

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        history = ctx.history
        j = len(history) - 1
        while j >= 0 and len(history) - 1 - j < self.reads and _reads(history[j]):
            j -= 1
        if j < 0:
            return []
        change = history[j]
        sig = key_signature(change)
        install = _installs(change)
        if not _EDITS.match(sig) and not install:
            return []
        files = set() if install else _edited(change)
        base = self.installed if install else self.confidence
        if not install and _WRITES.match(sig):
            # a whole file written: a rewrite of one the rollout used before, or a new one (which is run instead)
            earlier = (_command(call) for call in history[:j])
            base = self.rewritten if any(c is not None and _names(c, files) for c in earlier) else self.written
        out: list[Candidate] = []
        seen: set[CallKey] = set()
        naming = 0  # runs already proposed that name the edited file
        for call in reversed(history[:j]):
            if call in seen or _installs(call) or not _RUNS.match(key_signature(call)):
                continue
            seen.add(call)
            command = _command(call)
            named = command is not None and _names(command, files)
            p = self.named * self.decay**naming if named else base * self.decay ** len(out)
            naming += named
            out.append(Candidate(name=call.name, arguments=call.arguments(), probability=p, source=self.name))
            if len(out) >= self.top:
                break
        out.sort(key=lambda c: -c.probability)
        return out

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass
