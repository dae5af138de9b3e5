"""What the tool-call tap reports, as one tagged union (``type`` is the tag), in stream order.

Every event carries ``t``, the ``time.monotonic()`` at which the tap saw it, so callers can measure how early a
call became usable.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "ArgumentsComplete",
    "ArgumentsDelta",
    "MessageFinished",
    "TapEvent",
    "TextDelta",
    "ToolCall",
    "ToolNameKnown",
    "Usage",
    "UsageReported",
]


class Usage(msgspec.Struct, frozen=True):
    """Token counts as the endpoint reported them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ToolCall(msgspec.Struct, frozen=True):
    """A finished tool call: ``arguments`` parsed and valid for the tool's schema, ``raw`` the JSON as streamed."""

    index: int
    id: str
    name: str
    arguments: dict[str, Any]
    raw: str


class _Event(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    t: float


class TextDelta(_Event, frozen=True, tag="text_delta"):
    """A piece of the assistant's text."""

    text: str


class ToolNameKnown(_Event, frozen=True, tag="tool_name"):
    """Call ``index`` names a tool the caller declared; its arguments may still be streaming."""

    index: int
    id: str
    name: str


class ArgumentsDelta(_Event, frozen=True, tag="arguments_delta"):
    """A fragment of call ``index``'s arguments; ``partial`` is everything received so far (not yet valid JSON)."""

    index: int
    delta: str
    partial: str


class ArgumentsComplete(_Event, frozen=True, tag="arguments_complete"):
    """Call ``index``'s arguments parse and fit the tool's schema: the call can run now, before the message ends."""

    call: ToolCall


class MessageFinished(_Event, frozen=True, tag="message_finished"):
    """The endpoint sent ``finish_reason``; every tool call is complete and validated."""

    finish_reason: str
    content: str
    tool_calls: list[ToolCall]


class UsageReported(_Event, frozen=True, tag="usage"):
    """Token usage (``stream_options.include_usage``), which arrives after the message finished."""

    usage: Usage


TapEvent = TextDelta | ToolNameKnown | ArgumentsDelta | ArgumentsComplete | MessageFinished | UsageReported
