"""Chat-completions rendering of a replayed turn (``POST /v1/chat/completions``): the streamed chunks, their tail and
the whole completion, as ``_responses`` renders the Responses API's."""

from __future__ import annotations

import time

import msgspec

from ._turns import Rendered, Turn, token_pieces
from ._wire import (
    ChatChunk,
    ChatCompletion,
    ChatMessage,
    ChatRequest,
    ChunkChoice,
    CompletionChoice,
    Delta,
    FunctionCall,
    FunctionDelta,
    ToolCallDelta,
    WireToolCall,
    WireUsage,
    message_text,
)

_encoder = msgspec.json.Encoder()


def render_completion(
    chat: ChatRequest, key: str, turn: Turn, text: str, *, include_usage: bool, finish_flush: bool
) -> Rendered:
    """``turn`` as a chat completion: streamed chunks (``text`` as content deltas, then each call's name and its
    arguments in pieces), the tail (``finish_reason``, usage when ``include_usage``, ``[DONE]``) and the whole
    completion for a request that does not stream. ``finish_flush``: the last call's second half of arguments comes
    with ``finish_reason``, as some endpoints send it."""
    cid = f"chatcmpl-replay-{key}-{turn.index}"
    created = int(time.time())

    def event(delta: Delta, finish: str | None = None) -> bytes:
        chunk = ChatChunk(id=cid, created=created, model=chat.model, choices=[ChunkChoice(0, delta, finish)])
        return b"data: " + _encoder.encode(chunk) + b"\n\n"

    deltas: list[Delta] = [Delta(content=p) for p in token_pieces(text)]
    ids = [f"call_{turn.index}_{i}" for i in range(len(turn.calls))]
    finish = "stop" if turn.final or not turn.calls else "tool_calls"
    finish_delta = Delta()
    for i, call in enumerate(turn.calls):
        deltas.append(Delta(tool_calls=[ToolCallDelta(i, ids[i], "function", FunctionDelta(call.name, ""))]))
        pieces = token_pieces(call.raw)
        if finish_flush and i == len(turn.calls) - 1 and len(pieces) > 1:
            # Like some endpoints, send the rest of the last call's arguments with finish_reason.
            half = len(pieces) // 2
            pieces, rest = pieces[:half], "".join(pieces[half:])
            finish_delta = Delta(tool_calls=[ToolCallDelta(i, function=FunctionDelta(arguments=rest))])
        deltas += [Delta(tool_calls=[ToolCallDelta(i, function=FunctionDelta(arguments=p))]) for p in pieces]
    if not deltas:
        deltas.append(Delta(content=""))
    tokens = [event(d) for d in deltas]
    tokens[0] = event(Delta(role="assistant", content="")) + tokens[0]
    completion_tokens = turn.completion_tokens or len(deltas)
    prompt_chars = sum(len(message_text(m.content)) for m in chat.messages)
    prompt_tokens = turn.prompt_tokens or max(1, prompt_chars // 4)
    usage = WireUsage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
    tail_bytes = event(finish_delta, finish)
    if include_usage:
        usage_chunk = ChatChunk(id=cid, created=created, model=chat.model, choices=[], usage=usage)
        tail_bytes += b"data: " + _encoder.encode(usage_chunk) + b"\n\n"
    tail_bytes += b"data: [DONE]\n\n"
    message = ChatMessage(
        role="assistant",
        content=text or None,
        tool_calls=[WireToolCall(ids[i], "function", FunctionCall(c.name, c.raw)) for i, c in enumerate(turn.calls)]
        or None,
    )
    completion = ChatCompletion(cid, created, chat.model, [CompletionChoice(0, message, finish)], usage)
    return Rendered(tokens, tail_bytes, _encoder.encode(completion))
