"""A trajectory as the replay server serves it: its steps grouped into assistant turns (``build_turns``), the turn
that answers a request's messages (``match_turn``: pure functions over plain data, see ``_replay``'s doc for the
rules), and a turn cut into the pieces that are streamed as tokens."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from .._rollout._trajectory import Fault, Trajectory
from ._wire import ChatMessage, message_text

__all__ = [
    "Call",
    "MatchMode",
    "Rendered",
    "ReplayError",
    "Turn",
    "build_turns",
    "decode_args",
    "match_turn",
    "token_pieces",
]

MatchMode = Literal["skeleton", "exact"]

_PIECE = re.compile(r"\s*\S{1,6}|\s+")
_encoder = msgspec.json.Encoder()


class Call(msgspec.Struct, frozen=True):
    """A recorded tool call."""

    name: str
    args: Any  # the parsed arguments, or None when the recording's raw_args is not JSON
    raw: str  # what is streamed
    observation: str | None


class Turn(msgspec.Struct, frozen=True):
    """A recorded assistant turn: its calls (none for the final answer), text, LLM time and injected fault."""

    index: int
    calls: list[Call]
    text: str
    final: bool
    llm_seconds: float | None
    fault: Fault | None
    fault_times: int | None
    completion_tokens: int | None
    prompt_tokens: int | None


class ReplayError(Exception):
    """What the server answers instead of a turn: an HTTP ``status`` with an OpenAI-style error ``code``."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def decode_args(raw: str) -> Any:
    """The parsed arguments, or None when ``raw`` is not JSON."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


def build_turns(trajectory: Trajectory) -> list[Turn]:
    """Group a trajectory's steps into assistant turns (see ``bunshin_async._rollout._trajectory``)."""
    turns: list[Turn] = []
    group: int | None = None
    for step in trajectory.steps:
        if step.tool == "format_error" or step.kind == "format_error":
            continue
        if step.final:
            turns.append(
                Turn(len(turns), [], step.assistant_text or "", True, step.llm_seconds, step.fault,
                      step.fault_times, step.completion_tokens, step.prompt_tokens)
            )  # fmt: skip
            break
        assert step.tool is not None
        raw = step.raw_args if step.raw_args is not None else _encoder.encode(step.args or {}).decode()
        call = Call(step.tool, step.args if step.raw_args is None else decode_args(raw), raw, step.observation)
        if turns and step.turn is not None and step.turn == group:
            last = turns[-1]
            seconds = (last.llm_seconds or 0.0) + (step.llm_seconds or 0.0)
            turns[-1] = msgspec.structs.replace(
                last, calls=[*last.calls, call], llm_seconds=seconds if last.llm_seconds is not None else None
            )
        else:
            turns.append(
                Turn(len(turns), [call], step.assistant_text or "", False, step.llm_seconds, step.fault,
                      step.fault_times, step.completion_tokens, step.prompt_tokens)
            )  # fmt: skip
        group = step.turn
    return turns


def _describe(calls: Sequence[tuple[str, Any]]) -> str:
    if not calls:
        return "no tool call"
    return ", ".join(f"{name}({_encoder.encode(args).decode()[:120]})" for name, args in calls)


def match_turn(
    key: str, turns: list[Turn], messages: list[ChatMessage], mode: MatchMode, preamble: str | None = None
) -> int:
    """Index of the recorded turn that answers ``messages``; raises ``ReplayError`` naming the first mismatch."""
    assistants = [(i, m) for i, m in enumerate(messages) if m.role == "assistant"]
    for n, (pos, msg) in enumerate(assistants):
        if n >= len(turns) or turns[n].final:
            done = len(turns) if turns and turns[-1].final else len(turns)
            raise ReplayError(
                400, "replay_past_end",
                f"trajectory {key} has {done} assistant turns and the last one ended the conversation; the request "
                f"already has {len(assistants)} assistant messages",
                "messages",
            )  # fmt: skip
        rec = turns[n]
        got = [
            (tc.function.name, decode_args(tc.function.arguments) if tc.function.arguments.strip() else {})
            for tc in msg.tool_calls or ()
            if tc.function is not None
        ]
        want = [(c.name, c.args if c.args is not None else decode_args(c.raw)) for c in rec.calls]
        if got != want:
            raise ReplayError(
                400, "replay_prefix_mismatch",
                f"prefix mismatch with trajectory {key} at assistant turn {n} (messages[{pos}]): the request has "
                f"{_describe(got)}, the recording has {_describe(want)}",
                f"messages[{pos}]",
            )  # fmt: skip
        if mode == "exact":
            _match_exact(key, n, pos, rec, msg, messages, preamble)
    if len(assistants) >= len(turns):
        raise ReplayError(
            400, "replay_past_end",
            f"trajectory {key} has only {len(turns)} assistant turns and the request already has {len(assistants)}; "
            "the recording has no final answer to serve",
            "messages",
        )  # fmt: skip
    return len(assistants)


def _match_exact(
    key: str, n: int, pos: int, rec: Turn, msg: ChatMessage, messages: list[ChatMessage], preamble: str | None
) -> None:
    text = message_text(msg.content).strip()
    served = rec.text.strip() or (preamble or "").strip() if rec.calls else rec.text.strip()
    if text not in (rec.text.strip(), served):
        raise ReplayError(
            400, "replay_prefix_mismatch",
            f"prefix mismatch with trajectory {key} at assistant turn {n} (messages[{pos}]): text {text[:80]!r} "
            f"differs from the recorded {rec.text.strip()[:80]!r}",
            f"messages[{pos}]",
        )  # fmt: skip
    ids = [tc.id for tc in msg.tool_calls or ()]
    results = {}
    for later in messages[pos + 1 :]:
        if later.role != "tool":
            break
        results[later.tool_call_id] = message_text(later.content)
    for call_id, call in zip(ids, rec.calls, strict=False):
        if call_id not in results:
            raise ReplayError(
                400, "replay_prefix_mismatch",
                f"exact match with trajectory {key}: assistant turn {n} (messages[{pos}]) has no tool result for "
                f"call {call_id!r}",
                f"messages[{pos}]",
            )  # fmt: skip
        if call.observation is not None and results[call_id] != call.observation:
            raise ReplayError(
                400, "replay_prefix_mismatch",
                f"exact match with trajectory {key}: the tool result of call {call_id!r} at turn {n} differs from "
                f"the recorded observation",
                f"messages[{pos}]",
            )  # fmt: skip


def token_pieces(text: str) -> list[str]:
    """``text`` cut into token-sized pieces (a word of up to 6 characters with its leading blanks)."""
    return _PIECE.findall(text)


class Rendered(msgspec.Struct):
    """A turn as SSE events: ``tokens[i]`` is sent at ``offsets[i]``; ``tail`` right after the last token;
    ``body`` is the whole answer of a request that does not stream."""

    tokens: list[bytes]
    tail: bytes
    body: bytes
