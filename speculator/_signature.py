"""Tool-call signatures: a call's tool and program, the level at which patterns repeat across tasks."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from bunshin_async.speculation import CallKey

__all__ = ["INSTALL", "command_program", "installer", "key_signature", "signature"]

# A package manager asked to install or add something, anywhere in a command line (``mkdir -p x && pip install y``,
# ``python3 -c "import y" || pip install y``); the group ``manager`` names it. The one definition of an install
# for the kinds of call, the observation predictor's templates and the recent runs.
INSTALL = re.compile(
    r"\b(?P<manager>pip[\d.]*|python[\d.]*\s+-m\s+pip|apt(?:-get)?|conda|mamba|npm|yarn|pnpm|gem|cargo|uv|apk|dnf|"
    r"yum|brew|poetry|go)\b[^|;&\n]*(?<![\w-])(?:install|add)(?![\w-])"
)
# ``INSTALL`` in two parts, searched so that the work is linear in the command's length: the regex whole backtracks
# from every manager word to the end of its segment (one segment of 64 KB of ``pip pip ...`` took 14 s).
_MANAGER, _VERB = (re.compile(part) for part in INSTALL.pattern.split(r"[^|;&\n]*"))
_SEGMENT_END = re.compile(r"[|;&\n]")
_SPLIT = re.compile(r"&&|\|\||;|\n|\|")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_WRAPPERS = frozenset({"timeout", "nice", "env", "command", "nohup", "stdbuf", "sudo", "time"})


def command_program(command: str) -> str:
    """The program a shell command line is about: the first word of its first segment that is not a ``cd``,
    without its path and wrappers (``timeout 5``); ``python x.py`` -> ``python:x.py``-style detail is dropped
    except for ``python -m mod`` / ``python -c`` / script, which say what runs. A redirect into a file adds
    ``>``."""
    for segment in _SPLIT.split(command):
        try:
            words = shlex.split(segment, comments=False)
        except ValueError:
            words = segment.split()
        while words and (_ASSIGN.match(words[0]) or words[0] in _WRAPPERS or re.fullmatch(r"[\d.]+[smh]?", words[0])):
            words.pop(0)
        if not words or words[0] == "cd":
            continue
        prog = words[0].rsplit("/", 1)[-1]
        if re.fullmatch(r"python[\d.]*", prog):
            prog = "python"
            if len(words) > 2 and words[1] == "-m":
                prog = f"python -m {words[2]}"
            elif len(words) > 1 and words[1] == "-c":
                prog = "python -c"
            elif len(words) > 1:
                prog = "python script"
        if re.search(r"(?<![0-9&])>{1,2}\s*(?!/dev/null|&)", segment):
            prog += " >"
        return prog
    return ""


def installer(command: str) -> str | None:
    """The package manager a command line asks to install something (``pip3``, ``apt-get``, ``python -m pip``), or
    None if it installs nothing (``pip list`` does not)."""
    searched = -1  # where the last segment searched ends: a manager word before it sees less of that segment
    for m in _MANAGER.finditer(command):
        if m.end() <= searched:
            continue
        end = _SEGMENT_END.search(command, m.end())
        searched = end.start() if end is not None else len(command)
        if _VERB.search(command, m.end(), searched):
            return m["manager"]
    return None


def signature(name: str, args: Mapping[str, Any]) -> str:
    """``tool`` or ``tool:program`` for shell-like tools (an argument named ``command`` or ``cmd``)."""
    command = args.get("command", args.get("cmd"))
    if isinstance(command, str):
        return f"{name}:{command_program(command)}"
    return name


@lru_cache(maxsize=8192)
def key_signature(key: CallKey) -> str:
    """``signature`` of a canonical call, memoized: predictors ask it of every call of a rollout's history at every
    decision point, and parsing a command line is the costly part (milliseconds for a long history). Bounded: the
    cache holds its keys' arguments (heredocs can be large), and the live histories of a few dozen rollouts fit."""
    return signature(key.name, key.arguments())
