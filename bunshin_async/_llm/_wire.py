"""The OpenAI chat-completions wire format, as msgspec Structs shared by the client (decoding) and the replay
server (encoding). Unknown fields are ignored when decoding, so any compatible endpoint's extras pass through."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "ChatChunk",
    "ChatCompletion",
    "ChatMessage",
    "ChatRequest",
    "ChunkChoice",
    "CompletionChoice",
    "Delta",
    "ErrorBody",
    "ErrorResponse",
    "FunctionCall",
    "FunctionDelta",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "ToolCallDelta",
    "WireToolCall",
    "WireUsage",
    "message_text",
]


class FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct):
    index: int = 0
    delta: Delta | None = None
    finish_reason: str | None = None


class WireUsage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatChunk(msgspec.Struct):
    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChunkChoice] = msgspec.field(default_factory=list)
    usage: WireUsage | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str = ""


class WireToolCall(msgspec.Struct):
    id: str = ""
    type: str = "function"
    function: FunctionCall | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[Any] | None = None
    tool_calls: list[WireToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatRequest(msgspec.Struct):
    model: str
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: WireUsage | None = None
    object: str = "chat.completion"


class ErrorBody(msgspec.Struct):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class ModelCard(msgspec.Struct):
    id: str
    created: int = 0
    owned_by: str = "bunshin-replay"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


def message_text(content: str | list[Any] | None) -> str:
    """Text of a message's ``content``, whether a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
