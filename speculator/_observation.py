"""Predictors from what the previous call printed: the entity an error names, filled into the group's calls
(``ObservationPredictor``), and the commands a document quotes (``DocsPredictor``)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import xxhash

from bunshin_async.speculation import CallKey, Candidate, PredictionContext

from ._siblings import SiblingTable
from ._signature import _SPLIT, command_program, installer

__all__ = [
    "DocsPredictor",
    "ObservationPredictor",
]


# What an observation names that the next call is likely to take as an argument: the module of an import error,
# the program a shell could not find (bash: ``x: command not found``; dash, ``sh -c``'s shell on Debian:
# ``sh: 1: x: not found``), the package a Node script could not load (``Cannot find module 'x'``, not a path).
_ENTITIES = {
    "module": re.compile(r"No module named '([A-Za-z_][\w]*)(?:\.[\w.]*)?'"),
    # (and a program Python's ``subprocess`` could not start: its traceback ends in ``_execute_child``, then
    # ``FileNotFoundError: [Errno 2] No such file or directory: 'ffmpeg'``; ``open('data')`` prints the same error
    # from another frame, a file's)
    "program": re.compile(
        r"(?:^|\n)(?:\S+: )?(?:line \d+: )?([\w.+-]+): command not found|(?:^|\n)\S*sh: \d+: ([\w.+-]+): not found"
        r"|in _execute_child\n(?:[^\n]*\n){0,3}"
        r"FileNotFoundError: \[Errno 2\] No such file or directory: '([A-Za-z][\w+-]*)'"
    ),
    "node": re.compile(r"Cannot find module '(?![./])((?:@[\w.-]+/)?[\w.-]+)(?:/[^'\n]*)?'"),
}
_HOLE = "\x00{}\x00"

# Python modules whose distribution (what ``pip install`` takes) has another name: an import error names the
# module, the install that follows names the distribution.
DISTRIBUTIONS = {
    "cv2": "opencv-python",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "sklearn": "scikit-learn",
    "skimage": "scikit-image",
    "bs4": "beautifulsoup4",
    "dateutil": "python-dateutil",
    "dotenv": "python-dotenv",
    "jwt": "pyjwt",
    "magic": "python-magic",
    "serial": "pyserial",
    "Crypto": "pycryptodome",
    "attr": "attrs",
    "docx": "python-docx",
    "pptx": "python-pptx",
    "fitz": "pymupdf",
    "git": "gitpython",
    "usb": "pyusb",
    "zmq": "pyzmq",
    "OpenSSL": "pyopenssl",
    "websocket": "websocket-client",
    "Levenshtein": "python-levenshtein",
    "speech_recognition": "SpeechRecognition",
    "tensorflow_hub": "tensorflow-hub",
}


def _entities(output: str) -> dict[str, str]:
    found = {}
    for kind, pattern in _ENTITIES.items():
        hits = [h if isinstance(h, str) else next(g for g in h if g) for h in pattern.findall(output)]
        if hits:
            found[kind] = hits[-1]  # the last one printed is the one the run stopped on
    return found


def _named(kind: str, entity: str, text: str) -> str | None:
    """``text`` with ``entity`` (or, for a module, its distribution's name) cut out as ``kind``'s hole, if it
    names it as a word; None if it does not. A Python install names it as pip compares names (PEP 503: any case,
    a run of ``-``, ``_`` and ``.`` as any other): ``No module named 'Foo_Bar'``, then ``pip install foo-bar``."""
    pip = kind == "module" and (installer(text) or "").startswith(_PYTHON_INSTALLERS)
    for name in (entity, DISTRIBUTIONS.get(entity)) if kind == "module" else (entity,):
        if name and len(name) >= 2:
            if pip:
                spelled = "[-_.]+".join(re.escape(part) for part in re.split(r"[-_.]+", name))
                cut = re.sub(rf"(?<![\w.-]){spelled}(?![\w.-])", _HOLE.format(kind), text, flags=re.IGNORECASE)
            else:
                cut = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", _HOLE.format(kind), text)
            if cut != text:
                return cut
    return None


def _fill(kind: str, entity: str, args: str) -> str:
    """A template's hole filled with ``entity``: in a Python install, a module's distribution's name, and without
    another package index unless the index is named after it (``--index-url https://download.pytorch.org/whl/cpu``
    serves ``torch``, not ``numpy``)."""
    if (installer(args) or "").startswith(_PYTHON_INSTALLERS):
        entity = DISTRIBUTIONS.get(entity, entity) if kind == "module" else entity
        args = _INDEX.sub(lambda m: m.group(0) if entity.lower() in m.group(1).lower() else "", args)
    return args.replace(_HOLE.format(kind), entity)


# A package index an install names (``--index-url URL``, ``-i URL``, ``--extra-index-url URL``), with its space.
_INDEX = re.compile(r" (?:--index-url|--extra-index-url|-i)[ =](https?://[^\s\"]+)")


# Installers of Python distributions (what takes a distribution's name, not a module's).
_PYTHON_INSTALLERS = ("pip", "python", "conda", "mamba", "uv", "poetry")
# Installers of a system's programs (a program a shell did not find is installed by one of these, or by a Python
# installer when it is a Python tool's entry point).
_SYSTEM_INSTALLERS = ("apt", "apk", "dnf", "yum", "brew")
# Which installers' forms serve each kind of entity, the likelier first.
_FAMILIES = {"module": (_PYTHON_INSTALLERS,), "program": (_SYSTEM_INSTALLERS, _PYTHON_INSTALLERS),
             "node": (("npm", "yarn", "pnpm"),)}  # fmt: skip
# Options of an install that take the next word as their value (not a package): pip's, and apt's ``-o``.
_VALUED = frozenset(
    "--index-url --extra-index-url -i -c --constraint -t --target --timeout --trusted-host -f --find-links "
    "--prefix --root -o --option --registry".split()
)
# A program's name an install could take: not an option, not a file with an extension (``weights.json: command not
# found`` is a file run as a command), a version (``python3.11``) allowed.
_PROGRAM = re.compile(r"[A-Za-z][\w+-]*(?:\.\d+)*")


def _manager(args: str) -> str:
    """The package manager of a template's arguments (JSON text), or ""."""
    return installer(args) or ""


def _with_command(arguments: Mapping[str, Any], command: str) -> str:
    """``arguments`` (as JSON text) with ``command`` in place of their command; a hole in it stays a hole."""
    marker = "\ue000"
    arguments = {**arguments, "command": command.replace(_HOLE.format("form"), marker)}
    return msgspec.json.encode(arguments, order="deterministic").decode().replace(marker, _HOLE.format("form"))


def install_form(command: str) -> tuple[str, str] | None:
    """The form of a one-line command's install (its manager, as ``installer`` names it, and the install's own
    segment with its packages cut out as one hole where the first one stood): ``apt update && apt install -y a b``
    -> ``("apt", "apt install -y \\x00form\\x00")``, ``pip3 install x --index-url URL`` -> ``pip3 install <hole>
    --index-url URL``. None for no install, a multi-line one, or one that names no package (``pip install -r
    requirements.txt``, ``pip install -e .``)."""
    if "\n" in command.strip() or (manager := installer(command)) is None:
        return None
    for segment in _SPLIT.split(command):  # (a segment's blanks: ``split()``'s)
        words = segment.split()
        verb = next((i for i, w in enumerate(words) if w in ("install", "add")), None)
        if verb is None or installer(segment) is None:
            continue
        kept, hole, skip = words[: verb + 1], False, False
        for w in words[verb + 1 :]:
            if skip:
                kept.append(w)
                skip = False
            elif w.startswith("-"):
                if w in ("-r", "--requirement", "-e", "--editable"):
                    return None
                kept.append(w)
                skip = w in _VALUED
            elif not hole:
                kept.append(_HOLE.format("form"))
                hole = True
        return (manager, " ".join(kept)) if hole else None
    return None


class ObservationPredictor:
    """Argument filling from the last observation: when the latest call's output names a module an import failed
    on (``ModuleNotFoundError: No module named 'x'``), a program the shell did not find or a package a Node script
    could not load (``_ENTITIES``), predict the calls that
    followed such an observation before (in this rollout first, then in its siblings: the ``SiblingTable``'s
    templates) with the new name filled in (``pip install ... ./vendor/x``). A template is a one-line call whose
    arguments contained an entity one of the ``recall`` observations before it named (agents often read a file
    between an import error and the install), with the entity cut out, and does not run the entity itself (a
    retry of the missing program); a module's install may name its
    distribution instead (``cv2``, ``pip install opencv-python``: ``DISTRIBUTIONS``), and an install template is
    filled with the distribution of the module named next, without another package's index (``_fill``). A filled
    call the rollout already made is left out (``pip3 install torch --index-url URL`` ran, then ``No module named
    'torch'``: not that install again).

    Where no call followed such an error yet, what it names goes into the installs the rollout made, whatever they
    followed (``install_form``: the install's segment, its packages one hole): a module into a Python installer's
    form, a program (``x: command not found``, or ``FileNotFoundError ... 'x'`` from Python's ``subprocess``) into
    a system installer's (``apt-get install -y x``) and, at ``other_family`` of those odds, a Python installer's;
    the rollout's latest form at ``form``, each older ``older`` as likely, the group's by share (``group_form``),
    and for a module with no form known a plain ``pip install`` of its distribution (``default``); these guesses
    carry their own source (``form_source``). Their odds are
    half what was first tried (0.3, 0.2, 0.1): on the terminal-benchmark traces given a real run's observations
    its installs' guesses hit 6 times in 233 (the odds fitted seeing them: a factor of 0.18), and at those odds its
    wrong launches cost the sibling re-plan's run 0.02 points of group latency.

    Its odds are at most what its guesses scored on timed terminal-benchmark traces told, before each
    single-package pip install, the error that would have named the package (``scripts/eval_predictors.py``; the
    traces hold no observations, so an upper bound): the rollout's latest form was the exact call about half the
    time (``own``), an older one of its forms almost never (``older``: each is that much less likely than the
    next), a form the whole group used (the rollout itself included) about ``siblings``, one a part of it used
    much less than that part (one in ten at a third to a half: ``siblings`` times the share squared)."""

    name = "observation"
    #: The source of the forms' guesses: the policy calibrates each source by its hits, and a form is weaker
    #: evidence than a template (folded into one source, the forms' misses scaled the templates' right guesses
    #: down: with real observations and the re-plan, the 26 trace tasks in one run lost 0.09 points of latency).
    form_source = "observation-form"
    sources = (form_source,)  # the sources its guesses carry besides its name (``with_kind_odds``)

    def __init__(
        self,
        table: SiblingTable | None = None,
        *,
        own: float = 0.5,
        older: float = 0.1,
        siblings: float = 0.7,
        recall: int = 3,
        form: float = 0.15,
        group_form: float = 0.1,
        default: float = 0.05,
        other_family: float = 0.5,
    ) -> None:
        self.table = table if table is not None else SiblingTable()
        self.own_confidence, self.older = own, older
        self.sibling_confidence = siblings
        self.form, self.group_form, self.default, self.other_family = form, group_form, default, other_family
        self.own: dict[str, list[tuple[str, str]]] = defaultdict(list)
        # the rollout's latest install forms, (tool, arguments with a hole), in order (bounded: each guess reads them)
        self.forms: deque[tuple[str, str]] = deque(maxlen=16)
        self._recent: deque[dict[str, str]] = deque(maxlen=recall)  # the entities of the latest observations
        self._last_output: str | None = None

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        if ctx.position != len(ctx.decided) or not ctx.last_output:
            return []
        filled: dict[tuple[str, str], float] = {}
        formed: dict[tuple[str, str], float] = {}
        for kind, entity in _entities(ctx.last_output).items():
            scored: dict[tuple[str, str], float] = {}
            for rank, template in enumerate(reversed(self.own.get(kind, [])[-3:])):
                scored[template] = max(scored.get(template, 0.0), self.own_confidence * self.older**rank)
            counts = self.table.templates.get(kind)
            if counts:
                total = sum(counts.values())
                for template, n in counts.most_common(3):
                    scored[template] = max(scored.get(template, 0.0), self.sibling_confidence * (n / total) ** 2)
            for (name, args), p in scored.items():
                key = (name, _fill(kind, entity, args))
                filled[key] = max(filled.get(key, 0.0), p)
            # no call followed such an error yet: the installs the rollout (or group) made, as forms
            for (name, args), p in ({} if scored else self._forms(kind, entity, ctx)).items():
                key = (name, _fill(kind, entity, args.replace(_HOLE.format("form"), _HOLE.format(kind))))
                formed[key] = max(formed.get(key, 0.0), p)
        # a call the rollout already made did not prevent this error: agents change something (the told bound on
        # timed traces: the same hits, a fifth to a thirteenth of the wrong launches' seconds)
        made = {(c.name, c.args.decode()) for c in (*ctx.history, *ctx.decided)}
        sources = {**dict.fromkeys(formed, self.form_source), **dict.fromkeys(filled, self.name)}
        filled = {**formed, **filled}
        out = []
        for (name, args), p in sorted(filled.items(), key=lambda x: -x[1]):
            if (name, args) in made or p <= 0.0:
                continue
            try:
                arguments = msgspec.json.decode(args)
            except msgspec.DecodeError:
                continue
            if isinstance(arguments, dict):
                source = sources[name, args]
                out.append(Candidate(name=name, arguments=arguments, probability=p, source=source))
        return out[:3]

    def _forms(self, kind: str, entity: str, ctx: PredictionContext) -> dict[tuple[str, str], float]:
        """The install forms that could take ``entity`` (``_FAMILIES``), with their odds: the rollout's (latest
        first, each older ``older`` as likely), the group's (by share), else a Python installer's plain form for a
        module; each family after the first ``other_family`` as likely."""
        if kind == "program" and not _PROGRAM.fullmatch(entity):
            return {}
        out: dict[tuple[str, str], float] = {}
        group = self.table.templates.get("form") or Counter()
        total = sum(group.values())
        for rank, family in enumerate(_FAMILIES.get(kind, ())):
            scale = self.other_family**rank
            own = list(dict.fromkeys(t for t in reversed(self.forms) if _manager(t[1]).startswith(family)))
            for k, template in enumerate(own[:3]):
                out[template] = max(out.get(template, 0.0), self.form * self.older**k * scale)
            theirs = [(t, n) for t, n in group.most_common() if _manager(t[1]).startswith(family)][:3]
            for template, n in theirs:
                out[template] = max(out.get(template, 0.0), self.group_form * n / total * scale)
        if not out and kind == "module":
            tool = next((c.name for c in reversed(ctx.history) if isinstance(c.arguments().get("command"), str)), None)
            if tool is not None:
                out[tool, _with_command({}, f"pip install {_HOLE.format('form')}")] = self.default
        return out

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        command = call.arguments().get("command")
        form = install_form(command) if isinstance(command, str) else None
        if form is not None:  # whatever it followed: the rollout's way of installing
            template = (call.name, _with_command(call.arguments(), form[1]))
            self.forms.append(template)
            self.table.templates["form"][template] += 1
        if not ctx.last_output or ctx.position != len(ctx.decided):
            return
        if ctx.last_output != self._last_output:  # several calls of one message follow the same observation
            self._last_output = ctx.last_output
            self._recent.append(_entities(ctx.last_output))
        text = call.args.decode()
        if "\\n" in text:  # a script or a heredoc names the entity in passing: not an argument to fill in
            return
        runs = command_program(command).split(" ", 1)[0] if isinstance(command, str) else ""
        # (kind, entity) pairs, each once, the latest observation's first
        named = dict.fromkeys(pair for entities in reversed(self._recent) for pair in entities.items())
        for kind, entity in named:
            cut = _named(kind, entity, text)
            if cut is None or runs == entity:
                # (``yt-dlp: command not found``, then ``yt-dlp -f mp4 URL`` again: a retry of the missing program,
                # which filled with the next missing name, ``ffmpeg -f mp4 URL``, is a call no one makes)
                continue
            template = (call.name, cut)
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
