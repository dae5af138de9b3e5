"""Near misses: a decided ``CMD | tail -n N`` served by a branch that ran plain ``CMD``, and the text of a call's
outcome (what the model reads next, what a chained prediction is conditioned on)."""

from __future__ import annotations

import re
from typing import Any

from .._exceptions import InvalidArgument, ToolError
from .._host._protocol import ExecResult
from .._tools._tools import Tool
from ._calls import CallKey

__all__ = ["apply_tail", "filtered", "outcome", "outcome_text", "tail_lines"]

# `CMD | tail -n N` (or `tail -N`) where CMD is one simple command: no other pipe, list operator, background job,
# newline or output redirection anywhere in it (quoted or not: conservative), so that the pipeline prints CMD's
# stderr as it is and the last N lines of CMD's stdout, exits with tail's status (0: bash runs it without
# pipefail), and changes nothing CMD does not (tail reads all its input: CMD gets no SIGPIPE).
_TAIL = re.compile(r"^(?P<cmd>[^|;&\n>`]*[^|;&\n>`\s])\s*\|\s*tail\s+(?:-n\s*(?P<n>\d+)|-(?P<m>\d+))\s*$")


def filtered(tool: Tool, key: CallKey) -> tuple[CallKey, int] | None:
    """For a shell call ``CMD | tail -n N`` (``_TAIL``): the key of plain ``CMD`` (other arguments equal) and N."""
    args = key.arguments()
    command = args.get("command")
    if not isinstance(command, str) or tool.name != "bash":
        return None
    m = _TAIL.match(command)
    if m is None:
        return None
    try:
        inner = CallKey.of(tool, {**args, "command": m.group("cmd")})
    except InvalidArgument:
        return None
    return inner, int(m.group("n") or m.group("m"))


def tail_lines(text: str, n: int) -> str:
    """What ``tail -n n`` prints of ``text``: its last n lines (a last line without newline counts)."""
    lines = re.findall(r"[^\n]*\n|[^\n]+$", text)
    return "".join(lines[-n:]) if n > 0 else ""


def apply_tail(result: Any, error: ToolError | None, n: int) -> ExecResult | None:
    """``CMD | tail -n n``'s result from ``CMD``'s, or None when it cannot be known exactly (an error, a timeout,
    output cut at the size limit, output that is not valid UTF-8 text)."""
    if error is not None or not isinstance(result, ExecResult) or result.truncated or "\ufffd" in result.stdout:
        return None
    return ExecResult(exit_code=0, stdout=tail_lines(result.stdout, n), stderr=result.stderr,
                      duration=result.duration)  # fmt: skip


def outcome_text(result: Any, error: ToolError | None) -> str:
    """What a call printed: stdout then stderr, a string result as it is, or the tool error's message."""
    if error is not None:
        return str(error)
    if isinstance(result, ExecResult):
        return result.stdout + result.stderr
    return result if isinstance(result, str) else ""


def outcome(result: Any, error: ToolError | None) -> Any:
    """The result, or the ``ToolError`` in its place (what ``Executor.adopt`` takes)."""
    return error if error is not None else result
