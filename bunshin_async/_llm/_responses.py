"""The Responses API side of the replay server: a request's ``input`` items as the chat messages they stand for
(``responses_messages``, what turn matching reads) and a recorded turn as Responses events (``render_response``)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from .._exceptions import InvalidValue
from ._turns import Rendered, Turn, token_pieces
from ._wire import ChatMessage, FunctionCall, WireToolCall, message_text

__all__ = ["ResponsesRequest", "render_response", "responses_decoder", "responses_messages"]

_encoder = msgspec.json.Encoder()


class ResponsesRequest(msgspec.Struct):
    """What the replay server reads of a Responses API request (other fields are ignored)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False


responses_decoder = msgspec.json.Decoder(ResponsesRequest)


def responses_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """A Responses API ``input`` as the chat messages it stands for: ``function_call`` items join the assistant
    message just before them (or start one), ``function_call_output`` items are tool messages."""
    out: list[ChatMessage] = []
    if body.instructions:
        out.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        return [*out, ChatMessage(role="user", content=body.input)]
    joinable = False  # the last message is an assistant message that calls may still join
    for item in body.input:
        kind = item.get("type", "message")
        if kind == "function_call":
            call = WireToolCall(str(item.get("call_id", "")), "function",
                                FunctionCall(str(item["name"]), str(item.get("arguments", ""))))  # fmt: skip
            if joinable:
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
            joinable = True
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append(ChatMessage(role="tool", tool_call_id=str(item.get("call_id", "")),
                                   content=output if isinstance(output, str | list) else str(output)))  # fmt: skip
            joinable = False
        elif kind == "message" and "role" in item:
            content = item.get("content")
            if isinstance(content, list):
                content = [{"text": p.get("text", "")} for p in content if isinstance(p, dict)]
            out.append(ChatMessage(role=str(item["role"]), content=content))
            joinable = item["role"] == "assistant"
        elif kind == "reasoning":
            continue
        else:
            raise InvalidValue(f"input item of type {kind!r} is not supported by the replay server", argument="input")
    return out


def render_response(model: str, messages: list[ChatMessage], key: str, turn: Turn, text: str) -> Rendered:
    """``turn`` as Responses API events: a message item with ``text`` (if any), then one function_call item per
    call, each streamed as argument deltas; ``response.completed`` (with usage) is the tail."""
    rid = f"resp_replay_{key}_{turn.index}".replace(":", "_")
    created = int(time.time())
    seq = iter(range(1, 1 << 30))

    def event(kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: ".encode() + _encoder.encode(data) + b"\n\n"

    def response(status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
                "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "usage": usage}  # fmt: skip

    tokens: list[bytes] = []
    output: list[dict[str, Any]] = []
    head = event("response.created", response=response("in_progress", [], None))
    if text:
        mid = f"msg_{rid}"
        item = {"id": mid, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        pre = event("response.output_item.added", output_index=0, item=item)
        pieces = token_pieces(text)
        for i, piece in enumerate(pieces):
            tokens.append((pre if i == 0 else b"") + event(
                "response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=piece,
                logprobs=[]))  # fmt: skip
        part = {"type": "output_text", "text": text, "annotations": []}
        done = {**item, "status": "completed", "content": [part]}
        tokens[-1] += event(
            "response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text, logprobs=[]
        ) + event("response.output_item.done", output_index=0, item=done)
        output.append(done)
    for i, call in enumerate(turn.calls):
        index = len(output)
        fid = f"fc_{rid}_{i}"
        item = {"id": fid, "type": "function_call", "call_id": f"call_{turn.index}_{i}", "name": call.name,
                "arguments": "", "status": "in_progress"}  # fmt: skip
        pre = event("response.output_item.added", output_index=index, item=item)
        pieces = token_pieces(call.raw) or [""]
        for k, piece in enumerate(pieces):
            delta = event("response.function_call_arguments.delta", item_id=fid, output_index=index, delta=piece)
            tokens.append((pre if k == 0 else b"") + delta)
        done = {**item, "arguments": call.raw, "status": "completed"}
        tokens[-1] += event("response.function_call_arguments.done", item_id=fid, output_index=index,
                            name=call.name, arguments=call.raw) + event(
            "response.output_item.done", output_index=index, item=done)  # fmt: skip
        output.append(done)
    if not tokens:
        tokens.append(b"")
    tokens[0] = head + tokens[0]
    completion_tokens = turn.completion_tokens or len(tokens)
    prompt_chars = sum(len(message_text(m.content)) for m in messages)
    prompt_tokens = turn.prompt_tokens or max(1, prompt_chars // 4)
    usage = {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    final = response("completed", output, usage)
    return Rendered(tokens, event("response.completed", response=final), _encoder.encode(final))
