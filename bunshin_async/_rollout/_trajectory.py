"""Trajectory records: what an agent did, step by step, in the JSONL format of ``/work/shared/traces``.

One trajectory per line: ``{"task_id", "rollout", "steps": [{"tool", "args", "llm_seconds", "tool_seconds",
"assistant_text", ...}]}``. A step is one tool call; steps that share ``turn`` came from one assistant message (the
turn's LLM time and text sit on its first step, later steps carry ``llm_seconds: 0``). A step with ``tool`` null
(or ``"submit"``) ends the trajectory with a plain answer. Unknown fields of other producers are ignored on load.

Every field is written, null when unknown (as in the shared traces), so readers can index ``step["tool"]``. The
``raw_args``, ``fault`` and ``fault_times`` fields only drive the replay server's fault injection.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

from .._exceptions import InvalidValue

__all__ = [
    "Fault",
    "Step",
    "Trajectory",
    "dump_trajectories",
    "iter_trajectories",
    "load_trajectories",
]

#: Replay-server fault for the turn a step starts: an HTTP error status, a connection cut mid-stream, a stream
#: that stops sending (without closing) mid-stream.
Fault = Literal["http_500", "http_429", "http_503", "cut", "stall"]


class Step(msgspec.Struct):
    """One tool call (or the final answer when ``tool`` is None or ``"submit"``)."""

    tool: str | None = None
    args: dict[str, Any] | None = None
    llm_seconds: float | None = None
    tool_seconds: float | None = None
    assistant_text: str | None = None
    turn: int | None = None
    call_id: str | None = None
    observation: str | None = None
    exit_code: int | None = None
    kind: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    raw_args: str | None = None
    fault: Fault | None = None
    fault_times: int | None = None

    @property
    def final(self) -> bool:
        return self.tool is None or self.tool == "submit"


class Trajectory(msgspec.Struct):
    """A rollout: ``steps`` in order; ``messages`` is the full chat as sent to the model (agent-recorded only)."""

    task_id: str
    rollout: int = 0
    steps: list[Step] = msgspec.field(default_factory=list)
    model: str | None = None
    stop_reason: str | None = None
    wall_seconds: float | None = None
    messages: list[dict[str, Any]] | None = None

    @property
    def key(self) -> str:
        return f"{self.task_id}:{self.rollout}"

    def to_json(self) -> bytes:
        return _encoder.encode(self)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Trajectory)


def _open(path: str | os.PathLike[str], mode: Literal["rb", "wb"]) -> Any:
    return gzip.open(path, mode) if str(path).endswith(".gz") else open(path, mode)  # noqa: SIM115


def iter_trajectories(path: str | os.PathLike[str]) -> Iterator[Trajectory]:
    """Read a JSONL (or ``.jsonl.gz``) trajectory file lazily. Blocking: from async code use a worker thread."""
    with _open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise InvalidValue(f"{path}:{lineno}: not a trajectory: {exc}", argument="path") from None


def load_trajectories(path: str | os.PathLike[str]) -> list[Trajectory]:
    """Read a whole JSONL (or ``.jsonl.gz``) trajectory file. Blocking."""
    return list(iter_trajectories(path))


def dump_trajectories(path: str | os.PathLike[str], trajectories: Iterable[Trajectory]) -> Path:
    """Write trajectories as JSONL (gzip if the name ends in ``.gz``). Blocking."""
    with _open(path, "wb") as f:
        for trajectory in trajectories:
            f.write(_encoder.encode(trajectory) + b"\n")
    return Path(path)
