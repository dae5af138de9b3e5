"""The next case of a run the rollout steps through (``StepPredictor``): ``x.py 1``, ``x.py 2``, then ``x.py 3``."""

from __future__ import annotations

import re
from collections.abc import Sequence

from bunshin_async.speculation import CallKey, Candidate, PredictionContext

from ._recent import _RUNS
from ._signature import key_signature

__all__ = ["StepPredictor"]

# A program that is a script the command runs by path (``./maze_game.sh``, ``bin/run.py``).
_SCRIPT = re.compile(r"^bash:[\w.+-]+\.(?:sh|bash|py|js|mjs|rb|pl)$")

# A number that stands as a word of a one-line command (a case, an id, a size), not part of a name, a version, a
# path, an option's ``=value`` or a duration (``5s``).
_NUMBER = re.compile(r"(?<![\w.=:/-])\d{1,6}(?![\w.:/-])")


def _command(call: CallKey) -> str | None:
    command = call.arguments().get("command")
    return command if isinstance(command, str) and "\n" not in command.strip() else None


def _stepped(command: str, earlier: Sequence[str]) -> str | None:
    """``command`` with the number that went up by one since an ``earlier`` command of the same form (every other
    character equal) up by one more, if there is one; the last such number if several did."""
    numbers = list(_NUMBER.finditer(command))
    for m in reversed(numbers):
        n = int(m.group())
        if n == 0:
            continue
        before = f"{command[: m.start()]}{n - 1}{command[m.end() :]}"
        if before in earlier:
            return f"{command[: m.start()]}{n + 1}{command[m.end() :]}"
    return None


class StepPredictor:
    """After a one-line command that repeats an earlier one of the rollout with one number one higher (``python3
    solve.py 2`` after ``python3 solve.py 1``), the same command with that number one higher again: agents step
    through cases (mazes, test ids, inputs) one call at a time. Only runs (a script, a test runner, a build): a
    read's line range or a grep's context size steps too, rarely on. One case alone is no evidence of a sequence
    (the next call was ``x 2`` after ``x 1`` once in a hundred on timed terminal-benchmark traces); a step taken
    is: eight of ten such guesses hit there, but all in one task, so ``confidence`` is a prior, not a held-out
    calibration (``scripts/eval_predictors.py``). Looks back ``reach`` calls."""

    name = "steps"

    def __init__(self, *, confidence: float = 0.6, reach: int = 8) -> None:
        self.confidence = confidence
        self.reach = reach

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        calls = (*ctx.history, *ctx.decided)
        if not calls:
            return []
        last = calls[-1]
        command = _command(last)
        if command is None or not (_RUNS.match(sig := key_signature(last)) or _SCRIPT.match(sig)):
            return []  # a run steps through cases; a read's line range or a grep's context size rarely does
        earlier = [c for call in calls[-1 - self.reach : -1] if (c := _command(call)) is not None]
        stepped = _stepped(command, earlier)
        if stepped is None or stepped in earlier:
            return []
        return [Candidate(name=last.name, arguments={**last.arguments(), "command": stepped},
                          probability=self.confidence, source=self.name)]  # fmt: skip

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass
