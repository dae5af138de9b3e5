"""The first run of a script the rollout has just written (``WrittenPredictor``)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

import msgspec

from bunshin_async.speculation import CallKey, Candidate, PredictionContext

from ._siblings import SiblingTable

__all__ = ["WrittenPredictor"]

# A script file, by the interpreter its extension names (the run a fresh one gets when nothing was learned).
_RUNNERS = {
    ".py": "python3",
    ".sh": "bash",
    ".bash": "bash",
    ".js": "node",
    ".mjs": "node",
    ".rb": "ruby",
    ".pl": "perl",
}
_PATH = r"""(['"]?)(?P<path>[\w.~+/-]+(?:""" + "|".join(re.escape(e) for e in _RUNNERS) + r"))\1(?![\w.-])"
# Where the first line of a command writes a file: a redirection of cat/echo/printf (``cat > x.py <<'EOF'``,
# ``cat <<EOF > x.py``, ``echo ... > x.sh``) or tee's argument (``tee x.py <<EOF``).
_REDIRECT = re.compile(r"(?:^|[;&|]\s*)(?:cat|echo|printf)\b[^;&|\n]*?(?<![\d&])>{1,2}\s*" + _PATH)
_TEE = re.compile(r"\btee\s+(?:-a\s+)?" + _PATH)
_HOLE, _BASE = "\x00path\x00", "\x00base\x00"


def written_script(command: str) -> str | None:
    """The script file the first line of ``command`` writes (as the command names it), if any."""
    first = command.split("\n", 1)[0]
    m = _REDIRECT.search(first) or _TEE.search(first)
    return m.group("path") if m else None


def _script(call: CallKey) -> str | None:
    """The script ``call`` writes, unless ``call`` also runs it (then its first run is no longer to come)."""
    command = call.arguments().get("command")
    if not isinstance(command, str):
        return None
    path = written_script(command)
    return None if path is None or runs_written(command, path) else path


_DELIMITER = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")


def runs_written(command: str, path: str) -> bool:
    """Whether ``command``, which writes ``path``, also runs it after writing it (``cat > x.py <<'EOF'`` ... ``EOF``
    then ``python3 x.py``; ``echo ... > x.sh && bash x.sh``): what follows the heredoc's body (or the write, without
    one) names the script's file after an interpreter, or as ``./x``."""
    first, _, body = command.partition("\n")
    m = _DELIMITER.search(first)
    rest = first[m.end() :] if m else first
    if m and body:
        lines = body.split("\n")
        end = next((i for i, line in enumerate(lines) if line.strip() == m.group(2)), len(lines))
        rest += "\n" + "\n".join(lines[end + 1 :])
    elif body:
        rest += "\n" + body
    base = re.escape(path.rsplit("/", 1)[-1])
    return bool(
        re.search(
            rf"(?:^|[\s;&|(])(?:\S*/)?(?:python[\d.]*|bash|sh|node|ruby|perl)\s+(?:\S+\s+)*?['\"]?(?:\S*/)?{base}(?![\w.-])",
            rest,
        )
        or re.search(rf"(?:^|[\s;&|(])\./(?:\S*/)?{base}(?![\w.-])", rest)
    )


class WrittenPredictor:
    """After a call that writes a script (``cat > fix.py <<'EOF'``, ``tee run.sh``), its first run, in the form the
    rollout used for the scripts it wrote before (``cd /app && python3 X``, ``timeout 30 python3 X 1``; the latest
    first, ``own``), else in the forms its siblings used (``SiblingTable.templates``, by frequency, ``siblings``),
    else the interpreter its extension names (``python3 X``, or ``python X`` if that is how the rollout ran Python
    before; ``default``). Agents run a script they have just written: the traces say it is the next call more often
    than not, and no sibling made that exact call before."""

    name = "written"

    def __init__(
        self,
        table: SiblingTable | None = None,
        *,
        own: float = 0.35,
        siblings: float = 0.7,
        default: float = 0.4,
        top: int = 2,
    ) -> None:
        self.table = table if table is not None else SiblingTable()
        self.own_confidence, self.sibling_confidence, self.default_confidence = own, siblings, default
        self.top = top
        self.own: dict[str, list[tuple[str, str]]] = defaultdict(list)  # extension -> templates, oldest first

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        last = ctx.decided[-1] if ctx.decided else ctx.history[-1] if ctx.history else None
        path = _script(last) if last is not None else None
        if path is None:
            return []
        kind = _kind(path)
        scored: dict[tuple[str, str], float] = {}
        for rank, template in enumerate(reversed(self.own.get(kind, [])[-3:])):
            scored[template] = max(scored.get(template, 0.0), self.own_confidence * 0.5**rank)
        counts = self.table.templates.get(f"written{kind}")
        if counts:
            total = sum(counts.values())
            for template, n in counts.most_common(3):
                p = self.sibling_confidence * n / total  # its share of the group's first runs: hit ~0.7 x share
                scored[template] = max(scored.get(template, 0.0), p)
        if not scored:
            command = f"{_interpreter(kind, ctx.history)} {path}"
            return [Candidate(name="bash", arguments={"command": command}, probability=self.default_confidence,
                              source=self.name)]  # fmt: skip
        base = path.rsplit("/", 1)[-1]
        out = []
        for (name, args), p in sorted(scored.items(), key=lambda x: -x[1]):
            try:
                arguments = msgspec.json.decode(args.replace(_HOLE, path).replace(_BASE, base))
            except msgspec.DecodeError:
                continue
            if isinstance(arguments, dict):
                out.append(Candidate(name=name, arguments=arguments, probability=p, source=self.name))
        return out[: self.top]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        last = ctx.decided[-1] if ctx.decided else ctx.history[-1] if ctx.history else None
        path = _script(last) if last is not None else None
        if path is None:
            return
        text = call.args.decode()
        if "\\n" in text:  # another heredoc, not a run
            return
        base = path.rsplit("/", 1)[-1]
        template = text
        if "/" in path:
            template = re.sub(rf"(?<![\w./-]){re.escape(path)}(?![\w.-])", _HOLE, template)
        if template == text:
            template = re.sub(rf"(?<![\w.-]){re.escape(base)}(?![\w.-])", _BASE, text)
        if template == text:
            return
        kind = _kind(path)
        self.own[kind].append((call.name, template))
        self.table.templates[f"written{kind}"][call.name, template] += 1


def _interpreter(kind: str, history: Sequence[CallKey]) -> str:
    """The interpreter for ``kind``'s scripts: the one the rollout last ran by name (``python`` where that is what
    it types), else the extension's."""
    runner = _RUNNERS[kind]
    if runner != "python3":
        return runner
    for call in reversed(history):
        command = call.arguments().get("command")
        m = _PYTHON.search(command.split("\n", 1)[0]) if isinstance(command, str) else None
        if m:
            return m.group(1)
    return runner


_PYTHON = re.compile(r"(?:^|[;&|]\s*|\btimeout\s+\S+\s+)(python(?:3(?:\.\d+)?)?)\s")


def _kind(path: str) -> str:
    return next(e for e in _RUNNERS if path.endswith(e))
