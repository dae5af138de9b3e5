"""The tool-call tap: a push-driven state machine that turns streamed deltas into ``TapEvent``s as early as each
fact is knowable.

Arguments are complete as soon as the accumulated text is a JSON object that fits the tool's schema. A JSON object
cannot be extended and stay valid JSON, so this is final; it does not wait for the SDK's own "done" signal, which
for chat completions only comes when the next call starts or the message ends. Feeding is synchronous and cheap
(a parse is only tried when the text ends in ``}``), so the same machine serves the httpx client and the adapters
for ``openai`` streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from .._exceptions import LLMStreamError, ToolCallError
from .._tools._tools import Tool, lookup, validate_schema
from ._events import (
    ArgumentsComplete,
    ArgumentsDelta,
    MessageFinished,
    TapEvent,
    TextDelta,
    ToolCall,
    ToolNameKnown,
    Usage,
    UsageReported,
)

__all__ = ["ToolCallTap", "ToolsLike", "feed_chat_chunk", "feed_response_event", "tool_schemas"]


#: What the tap accepts as "the tools": the ``tools=`` list given to the endpoint (chat completions or Responses
#: shape), ``Tool`` objects, or a ``{name: schema}`` mapping.
ToolsLike = Iterable[Mapping[str, Any] | Tool] | Mapping[str, Mapping[str, Any]]


def tool_schemas(tools: ToolsLike) -> dict[str, Mapping[str, Any]]:
    """Normalize ``tools`` to ``{name: parameters schema}``."""
    if isinstance(tools, Mapping):
        return {str(k): v for k, v in tools.items()}
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        if isinstance(tool, Mapping):
            spec = tool.get("function", tool)  # chat completions nest under "function"; Responses does not
            out[spec["name"]] = spec.get("parameters") or {}
        else:
            out[tool.name] = tool.schema
    return out


class _Call:
    __slots__ = ("index", "id", "name", "parts", "text", "call")

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = ""
        self.name = ""
        self.parts: list[str] = []
        self.text = ""
        self.call: ToolCall | None = None


class ToolCallTap:
    """Feed it one message's deltas; each method returns the events they caused (possibly none).

    Raises ``ToolCallError`` for a tool that is not in ``tools`` (as soon as the name arrives), for arguments that
    are not JSON or do not fit the schema (when the message finishes), and ``LLMStreamError`` from ``end()`` when the
    stream stopped before a ``finish_reason``.
    """

    def __init__(self, tools: ToolsLike, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.schemas = tool_schemas(tools)
        self._clock = clock
        self._calls: dict[int, _Call] = {}
        self._text: list[str] = []
        self.finished: MessageFinished | None = None
        self.usage: Usage | None = None

    # ------------------------------------------------------------------------------------------------ inputs

    def text(self, delta: str) -> list[TapEvent]:
        if not delta:
            return []
        self._text.append(delta)
        return [TextDelta(text=delta, t=self._clock())]

    def tool_delta(
        self, index: int | None, call_id: str | None, name: str | None, arguments: str | None
    ) -> list[TapEvent]:
        """One tool-call delta. ``index`` None (some endpoints) means: a new call if ``call_id`` is new, else the
        latest call."""
        if self.finished is not None:
            raise LLMStreamError("tool-call delta after the message finished")
        if index is None:
            known = [c for c in self._calls.values() if call_id and c.id == call_id]
            if known:
                index = known[0].index
            elif call_id or not self._calls:
                index = len(self._calls)
            else:
                index = max(self._calls)
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = _Call(index)
        events: list[TapEvent] = []
        if call_id and not call.id:
            call.id = call_id
        if name and not call.name:
            lookup(self.schemas, name, index=index)
            call.name = name
            events.append(ToolNameKnown(index=index, id=call.id, name=name, t=self._clock()))
        if arguments:
            call.parts.append(arguments)
            call.text += arguments
            events.append(ArgumentsDelta(index=index, delta=arguments, partial=call.text, t=self._clock()))
            if call.call is not None and arguments.strip():
                raise ToolCallError(
                    f"arguments of {call.name} call {index} continue after a complete JSON object: {arguments!r}",
                    tool_name=call.name,
                    index=index,
                )
        if call.call is None and call.name and self._try_complete(call):
            assert call.call is not None
            events.append(ArgumentsComplete(call=call.call, t=self._clock()))
        return events

    def set_arguments(self, index: int, arguments: str) -> list[TapEvent]:
        """The endpoint's own final text for call ``index`` (Responses ``...arguments.done``); it wins over the
        deltas and must be complete."""
        call = self._calls.get(index)
        if call is None:
            raise LLMStreamError(f"arguments for unknown tool call {index}")
        events: list[TapEvent] = []
        if call.text != arguments:
            call.text, call.parts = arguments, [arguments]
        if call.call is None:
            call.call = self._finalize(call)
            events.append(ArgumentsComplete(call=call.call, t=self._clock()))
        return events

    def finish(self, finish_reason: str) -> list[TapEvent]:
        """``finish_reason`` arrived: every call must now be complete."""
        if self.finished is not None:
            return []
        events: list[TapEvent] = []
        for index in sorted(self._calls):
            call = self._calls[index]
            if call.call is None:
                call.call = self._finalize(call, finish_reason)
                events.append(ArgumentsComplete(call=call.call, t=self._clock()))
        calls = [self._calls[i].call for i in sorted(self._calls)]
        self.finished = MessageFinished(
            finish_reason=finish_reason,
            content="".join(self._text),
            tool_calls=[c for c in calls if c is not None],
            t=self._clock(),
        )
        events.append(self.finished)
        return events

    def report_usage(self, usage: Usage) -> list[TapEvent]:
        self.usage = usage
        return [UsageReported(usage=usage, t=self._clock())]

    def end(self) -> list[TapEvent]:
        """The stream ended; raises ``LLMStreamError`` if the message never finished."""
        if self.finished is None:
            partial = {c.index: c.text[-80:] for c in self._calls.values()}
            raise LLMStreamError(
                "the stream ended before the message finished (no finish_reason)"
                + (f"; partial tool calls: {partial}" if partial else "")
            )
        return []

    # ------------------------------------------------------------------------------------------------ state

    @property
    def content(self) -> str:
        return "".join(self._text)

    def partial_arguments(self, index: int) -> str:
        """The arguments text of call ``index`` received so far."""
        call = self._calls.get(index)
        return call.text if call else ""

    def _try_complete(self, call: _Call) -> bool:
        text = call.text.strip()
        if not (text.startswith("{") and text.endswith("}")):
            return False
        try:
            value = msgspec.json.decode(text)
        except msgspec.DecodeError:
            return False
        if not isinstance(value, dict) or validate_schema(self.schemas[call.name], value) is not None:
            return False  # final but wrong; _finalize reports it when the message ends
        call.call = ToolCall(index=call.index, id=call.id, name=call.name, arguments=value, raw=call.text)
        return True

    def _finalize(self, call: _Call, finish_reason: str = "") -> ToolCall:
        if not call.name:
            raise ToolCallError(f"tool call {call.index} has no tool name", tool_name="", index=call.index)
        text = call.text.strip() or "{}"  # some endpoints send nothing for a tool without parameters
        truncated = " (the output was cut at the token limit)" if finish_reason == "length" else ""
        try:
            value = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ToolCallError(
                f"arguments of {call.name} call {call.index} are not valid JSON{truncated}: {exc}; "
                f"got {call.text[:200]!r}",
                tool_name=call.name,
                index=call.index,
            ) from None
        if not isinstance(value, dict):
            raise ToolCallError(
                f"arguments of {call.name} call {call.index} should be a JSON object, got {call.text[:200]!r}",
                tool_name=call.name,
                index=call.index,
            )
        reason = validate_schema(self.schemas[call.name], value)
        if reason is not None:
            raise ToolCallError(
                f"arguments of {call.name} call {call.index} do not fit its schema: {reason}",
                tool_name=call.name,
                index=call.index,
            )
        return ToolCall(index=call.index, id=call.id, name=call.name, arguments=value, raw=call.text)


# ---------------------------------------------------------------------------------------------------- adapters
# Duck-typed over attribute names, so the same code reads ``openai``'s pydantic chunks and our msgspec ones.


def feed_chat_chunk(tap: ToolCallTap, chunk: Any) -> list[TapEvent]:
    """Feed one chat-completions chunk (choice 0 only; ``n > 1`` is not supported)."""
    events: list[TapEvent] = []
    for choice in chunk.choices or ():
        if choice.index != 0:
            continue
        delta = choice.delta
        if delta is not None:
            if delta.content:
                events += tap.text(delta.content)
            for tc in delta.tool_calls or ():
                fn = tc.function
                events += tap.tool_delta(
                    tc.index, tc.id, fn.name if fn is not None else None, fn.arguments if fn is not None else None
                )
        if choice.finish_reason:
            events += tap.finish(choice.finish_reason)
    usage = getattr(chunk, "usage", None)
    if usage is not None:
        events += tap.report_usage(
            Usage(
                prompt_tokens=usage.prompt_tokens or 0,
                completion_tokens=usage.completion_tokens or 0,
                total_tokens=usage.total_tokens or 0,
            )
        )
    return events


class ResponsesState:
    """Maps Responses API ``output_index`` to the tap's call index (calls counted in order of appearance)."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}


def feed_response_event(tap: ToolCallTap, state: ResponsesState, event: Any) -> list[TapEvent]:
    """Feed one Responses API stream event."""
    kind = getattr(event, "type", "")
    if kind == "response.output_text.delta":
        return tap.text(event.delta)
    if kind == "response.output_item.added" and getattr(event.item, "type", "") == "function_call":
        index = state.calls.setdefault(event.output_index, len(state.calls))
        item = event.item
        return tap.tool_delta(index, item.call_id, item.name, item.arguments or None)
    if kind == "response.function_call_arguments.delta":
        known = state.calls.get(event.output_index)
        if known is None:
            raise LLMStreamError(f"arguments for output item {event.output_index}, which is not a function call")
        return tap.tool_delta(known, None, None, event.delta)
    if kind == "response.function_call_arguments.done":
        done = state.calls.get(event.output_index)
        if done is None:
            raise LLMStreamError(f"arguments for output item {event.output_index}, which is not a function call")
        return tap.set_arguments(done, event.arguments)
    if kind in ("response.completed", "response.incomplete"):
        reason = "length" if kind == "response.incomplete" else ("tool_calls" if state.calls else "stop")
        events = tap.finish(reason)
        usage = getattr(event.response, "usage", None)
        if usage is not None:
            events += tap.report_usage(
                Usage(
                    prompt_tokens=usage.input_tokens or 0,
                    completion_tokens=usage.output_tokens or 0,
                    total_tokens=usage.total_tokens or 0,
                )
            )
        return events
    if kind in ("response.failed", "error"):
        error = getattr(getattr(event, "response", None), "error", None) or event
        raise LLMStreamError(f"the endpoint reported an error mid-stream: {getattr(error, 'message', error)}")
    return []
