"""The tool model: what a tool is, what it touches, and the built-in tools that run against a ``Workspace``.

The cache and the speculator decide from a call's *effect class* what they may do with it:

- ``pure``      depends on its arguments only (keyed on arguments, shared across states)
- ``read``      reads workspace state (keyed on the current state, does not advance it)
- ``write``     changes workspace state (advances the state chain; a hit needs a state restore)
- ``external``  touches the outside world: never cached, never speculated

A nondeterministic call (``deterministic=False``) is never cached either. Classification is conservative: when in
doubt a shell command is ``write``; callers can override per tool (``Tool.with_effect``) or per call.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from .._compat import StrEnum
from .._exceptions import InvalidArgument, ToolCallError
from .._host._protocol import DirEntry, ExecResult

if TYPE_CHECKING:
    from .._workspace._facade import Workspace

__all__ = [
    "CallClass",
    "Effect",
    "Handler",
    "Tool",
    "bash_tool",
    "builtin_tools",
    "classify_command",
    "list_dir_tool",
    "python_tool",
    "read_file_tool",
    "validate_schema",
    "write_file_tool",
]


class Effect(StrEnum):
    """What a call touches (see the module docstring): decides what the cache and the speculator may do with it."""

    PURE = "pure"
    READ = "read"
    WRITE = "write"
    EXTERNAL = "external"


class CallClass(msgspec.Struct, frozen=True):
    """How one call behaves: its effect class and whether the same call at the same state gives the same result."""

    effect: Effect
    deterministic: bool = True

    @property
    def cacheable(self) -> bool:
        return self.deterministic and self.effect is not Effect.EXTERNAL


_T = TypeVar("_T")

#: ``async def handler(workspace, args) -> result``; the result must be msgspec-encodable as ``Tool.result_type``.
Handler = Callable[["Workspace", dict[str, Any]], Awaitable[Any]]
#: Per-call classifier: normalized arguments -> class (the shell tool infers it from the command line).
Classifier = Callable[[Mapping[str, Any]], CallClass]


def _fingerprint_default(result: Any) -> Any:
    return result


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A tool an agent can call.

    ``schema`` is a JSON schema (an ``object`` with ``properties``) for the arguments; defaults in it are filled in
    before keying, so ``{"path": "a"}`` and ``{"path": "a", "max_bytes": null}`` are one call. Bump ``version``
    whenever the handler's behaviour changes: it is part of every cache key. ``classify``, when set, overrides
    ``effect``/``deterministic`` per call. ``touches_workspace=False`` says an ``external`` tool leaves the
    workspace alone (an MCP web search), so it does not end the cacheable chain. ``fingerprint`` maps a result to
    what an audit compares (timings dropped).
    """

    name: str
    schema: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object", "properties": {}})
    version: str = "1"
    effect: Effect = Effect.WRITE
    deterministic: bool = True
    description: str = ""
    handler: Handler | None = None
    result_type: Any = Any
    classify: Classifier | None = None
    touches_workspace: bool = True
    fingerprint: Callable[[Any], Any] = _fingerprint_default

    def classify_call(self, args: Mapping[str, Any]) -> CallClass:
        if self.classify is not None:
            return self.classify(args)
        return CallClass(self.effect, self.deterministic)

    def with_effect(self, effect: Effect | str, *, deterministic: bool | None = None) -> Tool:
        """This tool with a fixed effect class (the per-call classifier is dropped)."""
        return msgspec.structs.replace(
            self,
            effect=Effect(effect),
            deterministic=self.deterministic if deterministic is None else deterministic,
            classify=None,
        )

    def normalize(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """``args`` with defaults filled in and integral numbers made ints, after checking them against the schema
        (``validate_schema``). Raises ``InvalidArgument``."""
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            raise InvalidArgument(f"{self.name}: arguments must be an object with string keys", tool=self.name)
        props: Mapping[str, Any] = self.schema.get("properties") or {}
        out = dict(args)
        for key, spec in props.items():
            if key not in out and isinstance(spec, Mapping) and "default" in spec:
                out[key] = spec["default"]
        reason = validate_schema(self.schema, out)
        if reason is not None:
            raise InvalidArgument(f"{self.name}: {reason}", tool=self.name)
        for key, spec in props.items():
            value = out.get(key)
            if isinstance(value, float) and value.is_integer() and {"number", "integer"} & _type_names(spec):
                out[key] = int(value)  # 1.0 and 1 are one JSON number, hence one key
            elif isinstance(value, tuple):
                out[key] = list(value)
        return out

    def spec(self) -> dict[str, Any]:
        """An OpenAI-style function spec for the prompt."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.schema},
        }

    @classmethod
    def from_mcp(
        cls,
        spec: Mapping[str, Any],
        handler: Handler,
        *,
        version: str = "1",
        deterministic: bool = True,
        touches_workspace: bool = True,
        result_type: Any = Any,
    ) -> Tool:
        """A tool from an MCP tool description (``name``, ``inputSchema``, ``annotations``).

        MCP hints map conservatively, with MCP's own defaults (``openWorldHint`` true, ``readOnlyHint`` false):
        open-world -> ``external``, read-only -> ``read``, anything else -> ``write``. ``destructiveHint`` and
        ``idempotentHint`` refine only writes, which are cached the same way either way.
        """
        ann: Mapping[str, Any] = spec.get("annotations") or {}
        if ann.get("openWorldHint", True):
            effect = Effect.EXTERNAL
        elif ann.get("readOnlyHint", False):
            effect = Effect.READ
        else:
            effect = Effect.WRITE
        return cls(
            name=str(spec["name"]),
            schema=dict(spec.get("inputSchema") or {"type": "object", "properties": {}}),
            version=version,
            effect=effect,
            deterministic=deterministic,
            description=str(spec.get("description") or ""),
            handler=handler,
            touches_workspace=touches_workspace,
            result_type=result_type,
        )


def lookup(tools: Mapping[str, _T], name: str, *, index: int = 0) -> _T:
    """The tool (or schema) the model called ``name``, ``index``-th in its message; ``ToolCallError`` naming the known
    ones when there is none: the one place that says so, for the tap, the agent loop, the cache and the runtime."""
    if name not in tools:
        raise ToolCallError(f"unknown tool {name!r}; known: {', '.join(sorted(tools))}", tool_name=name, index=index)
    return tools[name]


# ---------------------------------------------------------------------------------------------- argument schemas


def _type_names(schema: Any) -> set[str]:
    types = schema.get("type") if isinstance(schema, Mapping) else None
    return {types} if isinstance(types, str) else set(types or ())


def _type_ok(name: str, value: Any) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "string":
        return isinstance(value, str)
    if name == "integer":
        # JSON has one number type: 3.0 is an integer for JSON schema.
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "array":
        return isinstance(value, list | tuple)
    if name == "null":
        return value is None
    return True  # an unknown type name constrains nothing


def validate_schema(schema: Mapping[str, Any], value: Any, path: str = "") -> str | None:
    """Check ``value`` against the JSON-schema subset tool parameters use; None if it fits, else a one-line reason
    naming the offending path (``$.command``).

    Supported keywords: ``type`` (object, string, integer, number, boolean, array, null, or a list of them),
    ``properties``, ``required``, ``additionalProperties`` (bool or schema), ``items``, ``enum``, ``const``,
    ``anyOf``/``oneOf`` (any branch matching is enough). Everything else (``description``, ``default``, formats,
    bounds) is ignored, so a schema the validator does not fully understand only ever accepts more, never less.
    """
    here = path or "$"
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_type_ok(n, value) for n in names):
            return f"{here} should be {' or '.join(names)}, not {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{here} should be one of {list(schema['enum'])!r}, not {value!r}"
    if "const" in schema and value != schema["const"]:
        return f"{here} should be {schema['const']!r}, not {value!r}"
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if branches:
            reasons = [validate_schema(b, value, path) for b in branches]
            if all(r is not None for r in reasons):
                return f"{here} matches none of {key}: {reasons[0]}"
    if isinstance(value, dict):
        props: Mapping[str, Any] = schema.get("properties") or {}
        for name in schema.get("required") or ():
            if name not in value:
                return f"{here} lacks required property {name!r}"
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            sub = props.get(name)
            if sub is not None:
                reason = validate_schema(sub, item, f"{here}.{name}")
                if reason:
                    return reason
            elif extra is False:
                return f"{here} has unexpected property {name!r}"
            elif isinstance(extra, Mapping):
                reason = validate_schema(extra, item, f"{here}.{name}")
                if reason:
                    return reason
    if isinstance(value, list | tuple):
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                reason = validate_schema(items, item, f"{here}[{i}]")
                if reason:
                    return reason
    return None


# ---------------------------------------------------------------------------------------------- shell classifier

#: Programs that never change workspace state by themselves (output redirection is checked separately).
READ_ONLY_PROGRAMS = frozenset(
    """
    ls cat grep egrep fgrep rg ag head tail wc nl pwd echo printf true false test [ stat file du df tree which type
    whoami id uname printenv realpath dirname basename readlink cut tr diff cmp comm md5sum sha1sum sha256sum
    less more cd export column fold expand strings od hexdump xxd jq pip-list
    """.split()
)
#: Programs whose output differs between two runs on the same state.
NONDETERMINISTIC_PROGRAMS = frozenset("date uuidgen shuf mktemp ps top uptime free time hostid".split())
#: Programs that reach outside the workspace.
EXTERNAL_PROGRAMS = frozenset("curl wget ssh scp rsync nc telnet ftp".split())
GIT_READ_SUBCOMMANDS = frozenset(
    "status diff log show blame grep ls-files rev-parse describe cat-file ls-tree shortlog".split()
)
GIT_EXTERNAL_SUBCOMMANDS = frozenset("clone fetch pull push ls-remote".split())
_FIND_WRITE_ACTIONS = frozenset("-delete -fprint -fprint0 -fprintf -fls -ok -okdir".split())
_PUNCT = frozenset("();<>|&\n")
_SEPARATORS = frozenset({"|", "||", "&&", ";", "&", "|&", "\n", ";;"})
_NONDET_TEXT = re.compile(r"\$RANDOM|\$\$|\$SRANDOM|/dev/u?random|\$EPOCH")
_WORD_SPLIT_UNSAFE = re.compile(r"\$\(|`|<\(|>\(")


def classify_command(command: str, *, read_only: Iterable[str] = (), nondeterministic: Iterable[str] = ()) -> CallClass:
    """Classify a bash command line conservatively.

    A command is ``read`` only if every part of every pipeline and ``&&``/``;`` chain is a known read-only program
    and nothing redirects output to a file (``>``, ``>>``; ``/dev/null`` and fd duplication are fine). Command
    substitution, process substitution and here-documents of unknown programs make it ``write``. ``read_only``
    and ``nondeterministic`` extend the built-in program lists.
    """
    return _classify(command, frozenset(read_only), frozenset(nondeterministic))


@functools.lru_cache(maxsize=4096)
def _classify(command: str, extra_read_only: frozenset[str], extra_nondeterministic: frozenset[str]) -> CallClass:
    # Agents repeat commands a lot (siblings most of all): tokenizing once per distinct command keeps hits cheap.
    ro = READ_ONLY_PROGRAMS | extra_read_only
    nondet = NONDETERMINISTIC_PROGRAMS | extra_nondeterministic
    deterministic = _NONDET_TEXT.search(command) is None
    if _WORD_SPLIT_UNSAFE.search(command):
        return CallClass(Effect.WRITE, deterministic)
    try:
        lex = shlex.shlex(command, posix=True, punctuation_chars="();<>|&\n")
        lex.whitespace = " \t\r"
        lex.whitespace_split = True
        lex.commenters = ""
        tokens = list(lex)
    except ValueError:  # unbalanced quotes: bash would fail too, but do not guess
        return CallClass(Effect.WRITE, deterministic)
    effect = Effect.READ
    segment: list[str] = []
    i = 0
    while i <= len(tokens):
        tok = tokens[i] if i < len(tokens) else "\n"
        if tok and set(tok) <= _PUNCT and ("(" in tok or ")" in tok):
            tok = tok.replace("(", "").replace(")", "")  # grouping: a subshell's cd does not outlive the command
            if not tok:
                i += 1
                continue
        if tok in _SEPARATORS or (tok and set(tok) <= set(";&|\n")):
            eff, det = _classify_simple(segment, ro, nondet)
            effect = _worse(effect, eff)
            deterministic = deterministic and det
            segment = []
        elif tok in (">", ">>", ">|", "&>", "&>>", "<>"):
            target = tokens[i + 1] if i + 1 < len(tokens) else ""
            if target != "/dev/null":
                effect = _worse(effect, Effect.WRITE)
            i += 1
        elif tok in (">&", "<&"):
            i += 1  # 2>&1: fd duplication, no file written
        elif tok in ("<", "<<", "<<<", "<<-"):
            segment.append(tok)
            i += 1
            if i < len(tokens):
                segment.append(tokens[i])
        elif tok in ("{", "}"):
            pass
        else:
            segment.append(tok)
        i += 1
    return CallClass(effect, deterministic)


_RANK = {Effect.PURE: 0, Effect.READ: 1, Effect.WRITE: 2, Effect.EXTERNAL: 3}


def _worse(a: Effect, b: Effect) -> Effect:
    return a if _RANK[a] >= _RANK[b] else b


def _classify_simple(words: Sequence[str], ro: frozenset[str], nondet: frozenset[str]) -> tuple[Effect, bool]:
    words = list(words)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words.pop(0)  # FOO=bar cmd
    if words and words[0] in ("<", "<<", "<<<", "<<-"):
        words = words[2:]
    if not words:
        return Effect.READ, True
    prog = words[0].rsplit("/", 1)[-1]
    args = words[1:]
    if prog in ("timeout", "nice", "command", "env", "stdbuf", "nohup"):
        rest = [a for a in args if not a.startswith("-") and "=" not in a]
        if prog == "timeout" and rest:
            rest = rest[1:]
        if prog == "env" and not rest:
            return Effect.READ, True
        idx = args.index(rest[0]) if rest else len(args)
        return _classify_simple(args[idx:], ro, nondet)
    if prog in nondet:
        return Effect.READ, False
    if prog in EXTERNAL_PROGRAMS:
        return Effect.EXTERNAL, False
    if prog == "git":
        while args and args[0].startswith("-"):
            opt = args.pop(0)
            if opt in ("-C", "-c") and args:
                args.pop(0)
        if not args:
            return Effect.READ, True
        if args[0] in GIT_EXTERNAL_SUBCOMMANDS:
            return Effect.EXTERNAL, False
        if args[0] in GIT_READ_SUBCOMMANDS and not any(a.startswith("--output") for a in args):
            return Effect.READ, True
        if args[0] == "branch" and all(a in ("-a", "-r", "-v", "-vv", "--list", "--show-current") for a in args[1:]):
            return Effect.READ, True
        return Effect.WRITE, True
    if prog == "sed":
        in_place = any(a == "-i" or a.startswith(("-i", "--in-place")) for a in args)
        quiet = any(a in ("-n", "--quiet", "--silent") or re.fullmatch(r"-[a-zA-Z]*n[a-zA-Z]*", a) for a in args)
        return (Effect.READ if quiet and not in_place else Effect.WRITE), True
    if prog == "find":
        if any(a in _FIND_WRITE_ACTIONS for a in args):
            return Effect.WRITE, True
        for j, a in enumerate(args):
            if a in ("-exec", "-execdir"):
                end = next((k for k in range(j + 1, len(args)) if args[k] in (";", "\\;", "+")), len(args))
                sub = [w for w in args[j + 1 : end] if w != "{}"]
                eff, det = _classify_simple(sub, ro, nondet)
                if eff is not Effect.READ:
                    return eff, det
        return Effect.READ, True
    if prog == "xargs":
        first = next((k for k, a in enumerate(args) if not a.startswith("-")), None)
        if first is not None and args[first] in ro:
            return _classify_simple(args[first:], ro, nondet)
        return Effect.WRITE, True
    if prog in ("sort",):
        return (Effect.WRITE if any(a.startswith(("-o", "--output")) for a in args) else Effect.READ), True
    if prog == "uniq":
        return (Effect.WRITE if len([a for a in args if not a.startswith("-")]) > 1 else Effect.READ), True
    if prog == "awk":
        script = " ".join(args)
        return (Effect.WRITE if (">" in script or "system(" in script or "|" in script) else Effect.READ), True
    if prog in ro:
        return Effect.READ, True
    return Effect.WRITE, True


# ---------------------------------------------------------------------------------------------- built-in tools


def _exec_fingerprint(result: Any) -> Any:
    if isinstance(result, ExecResult):
        return (result.exit_code, result.stdout, result.stderr, result.truncated)
    return result


async def _bash(ws: Workspace, args: dict[str, Any]) -> ExecResult:
    return await ws.exec(args["command"], timeout=args.get("timeout"))


async def _python(ws: Workspace, args: dict[str, Any]) -> ExecResult:
    return await ws.exec(["python3", "-"], stdin=args["code"], timeout=args.get("timeout"))


async def _read_file(ws: Workspace, args: dict[str, Any]) -> str:
    return (await ws.read_file(args["path"], max_bytes=args.get("max_bytes"))).decode("utf-8", "replace")


async def _write_file(ws: Workspace, args: dict[str, Any]) -> None:
    await ws.write_file(args["path"], args["content"], append=args.get("append", False))


async def _list_dir(ws: Workspace, args: dict[str, Any]) -> list[DirEntry]:
    return await ws.list_dir(args["path"])


def bash_tool(
    *, timeout: float = 120.0, read_only: Iterable[str] = (), nondeterministic: Iterable[str] = (), version: str = "1"
) -> Tool:
    """Run a bash command (a fresh process per call, so ``cd`` does not carry over); ``timeout`` (seconds) is the
    default of the call's ``timeout`` argument. Its class is inferred per command by ``classify_command``;
    ``read_only``/``nondeterministic`` add program names to the built-in lists."""
    ro, nd = tuple(read_only), tuple(nondeterministic)

    def classify(args: Mapping[str, Any]) -> CallClass:
        return classify_command(str(args.get("command", "")), read_only=ro, nondeterministic=nd)

    return Tool(
        name="bash",
        description="Run a bash command in the workspace; returns exit code, stdout and stderr.",
        schema={
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "timeout": {"type": ["number", "null"], "default": timeout},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
        version=version,
        effect=Effect.WRITE,
        handler=_bash,
        result_type=ExecResult,
        classify=classify,
        fingerprint=_exec_fingerprint,
    )


def python_tool(*, timeout: float = 120.0, version: str = "1") -> Tool:
    """Run a Python cell (``python3 -``, a fresh interpreter per call; ``timeout`` as for ``bash_tool``). Assumed to
    change the workspace."""
    return Tool(
        name="python",
        description="Run Python code in the workspace; returns exit code, stdout and stderr.",
        schema={
            "type": "object",
            "properties": {"code": {"type": "string"}, "timeout": {"type": ["number", "null"], "default": timeout}},
            "required": ["code"],
            "additionalProperties": False,
        },
        version=version,
        effect=Effect.WRITE,
        handler=_python,
        result_type=ExecResult,
        fingerprint=_exec_fingerprint,
    )


def read_file_tool(*, version: str = "1") -> Tool:
    """``read_file``: a text file of the workspace (``read``)."""
    return Tool(
        name="read_file",
        description="Read a text file of the workspace.",
        schema={
            "type": "object",
            "properties": {"path": {"type": "string"}, "max_bytes": {"type": ["integer", "null"], "default": None}},
            "required": ["path"],
            "additionalProperties": False,
        },
        version=version,
        effect=Effect.READ,
        handler=_read_file,
        result_type=str,
    )


def write_file_tool(*, version: str = "1") -> Tool:
    """``write_file``: create or replace a file of the workspace (``write``)."""
    return Tool(
        name="write_file",
        description="Write (or append to) a text file of the workspace, creating parent directories.",
        schema={
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "append": {"type": "boolean", "default": False},
            },
            "required": ["path", "content"],
            "additionalProperties": False,
        },
        version=version,
        effect=Effect.WRITE,
        handler=_write_file,
        result_type=None,
    )


def list_dir_tool(*, version: str = "1") -> Tool:
    """``list_dir``: a directory's entries, kind and size (``read``)."""
    return Tool(
        name="list_dir",
        description="List a directory of the workspace (name, kind, size).",
        schema={
            "type": "object",
            "properties": {"path": {"type": "string", "default": "."}},
            "additionalProperties": False,
        },
        version=version,
        effect=Effect.READ,
        handler=_list_dir,
        result_type=list[DirEntry],
    )


def builtin_tools() -> list[Tool]:
    """``bash``, ``read_file``, ``write_file``, ``list_dir`` and ``python``."""
    return [bash_tool(), read_file_tool(), write_file_tool(), list_dir_tool(), python_tool()]
