"""The rollout's own recent runs, repeated after an edit (``RecentPredictor``)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from bunshin_async.speculation import CallKey, Candidate, PredictionContext

from ._signature import key_signature

__all__ = [
    "RecentPredictor",
]


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
