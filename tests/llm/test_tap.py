"""The tool-call tap on real ``openai`` SDK streams from the replay server over loopback."""

from __future__ import annotations

from typing import Any

import anyio
import openai
import pytest
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseTextDeltaEvent,
    ResponseUsage,
)

from bunshin_async import ToolCallError
from bunshin_async._llm._turns import Rendered
from bunshin_async.llm import (
    ArgumentsComplete,
    ArgumentsDelta,
    FixedTiming,
    MessageFinished,
    ReplayServer,
    TextDelta,
    ToolNameKnown,
    UsageReported,
    replay_server,
    tap_openai_stream,
    tee_openai_stream,
)
from bunshin_async.rollout import Step

from .conftest import TOOLS, traj

pytestmark = pytest.mark.unit

TRICKY = {"command": 'printf "a}b{c\\n" | grep -E \'[{}]\' && echo "é ✓ \\"q\\"" # }'}
TWO_CALLS = traj(
    "two",
    Step("bash", TRICKY, assistant_text="First I look, then I read.", turn=0),
    Step("read", {"path": "src/x.py", "max_lines": 40}, turn=0),
    Step(None, assistant_text="done"),
)


async def _stream(client: openai.AsyncOpenAI, model: str, **kw: Any) -> Any:
    return await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "go"}], tools=TOOLS, stream=True, **kw
    )


@pytest.mark.parametrize("finish_flush", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
async def test_reassembles_exactly(make_client: Any, finish_flush: bool, include_usage: bool) -> None:
    opts = {"stream_options": {"include_usage": True}} if include_usage else {}
    async with replay_server([TWO_CALLS], timing=FixedTiming(0.0, 0.0), finish_flush=finish_flush) as url:
        stream = await _stream(make_client(url), "replay:two:0", **opts)
        with anyio.fail_after(10):
            async with tap_openai_stream(stream, TOOLS) as tap:
                events = [e async for e in tap]
    # What the SDK's chunks say, reassembled independently of the tap.
    raw: dict[int, str] = {}
    for chunk in tap.chunks:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or ():
                raw[tc.index] = raw.get(tc.index, "") + (tc.function.arguments or "")
    finished = [e for e in events if isinstance(e, MessageFinished)]
    assert len(finished) == 1
    calls = finished[0].tool_calls
    assert [(c.name, c.arguments) for c in calls] == [("bash", TRICKY), ("read", {"path": "src/x.py", "max_lines": 40})]
    assert [c.raw for c in calls] == [raw[0], raw[1]]
    assert [c.id for c in calls] == ["call_0_0", "call_0_1"]
    assert finished[0].content == "First I look, then I read."
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == finished[0].content
    assert finished[0].finish_reason == "tool_calls"
    # Each call's fragments come in several deltas and ``partial`` accumulates them.
    for index in (0, 1):
        deltas = [e for e in events if isinstance(e, ArgumentsDelta) and e.index == index]
        assert len(deltas) >= 2
        assert deltas[-1].partial == raw[index]
    usage = [e for e in events if isinstance(e, UsageReported)]
    assert bool(usage) == include_usage
    if include_usage:
        assert events[-1] is usage[0] and usage[0].usage.completion_tokens > 0
    # Exactly one ArgumentsComplete per call, in call order.
    assert [e.call.index for e in events if isinstance(e, ArgumentsComplete)] == [0, 1]


async def test_first_call_complete_before_second_starts(make_client: Any) -> None:
    """The tap knows call 0 the moment its last fragment arrives: before the next chunk of the stream is read (call
    1's first), and long before the message ends (the SDK itself only marks a call done then). Told by how many of
    the stream's chunks the tap had taken when it said so, not by the clock."""
    async with replay_server([TWO_CALLS], timing=FixedTiming(0.0, 0.0)) as url:
        stream = await _stream(make_client(url), "replay:two:0")
        async with tap_openai_stream(stream, TOOLS) as tap:
            taken = [(e, len(tap.chunks)) async for e in tap]  # each event with the chunks read when it came
    events = [e for e, _ in taken]
    kinds = [(type(e).__name__, getattr(e, "index", getattr(getattr(e, "call", None), "index", None))) for e in events]
    complete0 = kinds.index(("ArgumentsComplete", 0))
    assert complete0 < kinds.index(("ToolNameKnown", 1)) < kinds.index(("ArgumentsDelta", 1))
    assert kinds.index(("ArgumentsDelta", 1)) < kinds.index(("MessageFinished", None))
    assert kinds[complete0 - 1] == ("ArgumentsDelta", 0)  # said on call 0's last fragment, not later

    def calls_in(chunk: Any) -> set[int]:
        return {tc.index for choice in chunk.choices for tc in choice.delta.tool_calls or ()}

    read = taken[complete0][1]  # chunks the tap had read when it said call 0 was complete
    assert 0 in calls_in(tap.chunks[read - 1])  # the chunk that completed it was call 0's
    assert all(1 not in calls_in(c) for c in tap.chunks[:read])  # nothing of call 1 had been read yet
    assert not any(choice.finish_reason for c in tap.chunks[:read] for choice in c.choices)
    fragments1 = [c for c in tap.chunks[read:] if 1 in calls_in(c)]
    assert len(fragments1) >= 2  # call 1 streamed in several chunks after it


async def test_unknown_tool_raises_when_named(make_client: Any) -> None:
    t = traj("u", Step("python", {"code": "print(1)"}, assistant_text="let me use python"), Step(None))
    async with replay_server([t], timing=FixedTiming(0.0, 0.01)) as url:
        stream = await _stream(make_client(url), "replay:u:0")
        seen: list[Any] = []
        with anyio.fail_after(10), pytest.raises(ToolCallError) as info:
            async for event in tap_openai_stream(stream, TOOLS):
                seen.append(event)
    assert info.value.tool_name == "python" and info.value.index == 0
    assert str(info.value) == "unknown tool 'python'; known: bash, read"
    assert not any(isinstance(e, MessageFinished) for e in seen)  # raised as soon as the name arrived
    assert stream.response.is_closed


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (Step("bash", raw_args='{"command": "ls"'), "not valid JSON"),
        (Step("bash", raw_args='{"command": "ls"}}'), "not valid JSON"),
        (Step("bash", raw_args='{"command": "ls"} }'), "continue after a complete JSON object"),
        (Step("bash", {"cmd": "ls"}), "lacks required property 'command'"),
        (Step("read", {"path": "a", "mode": "x"}), "unexpected property 'mode'"),
    ],
)
async def test_bad_arguments(make_client: Any, step: Step, message: str) -> None:
    async with replay_server([traj("m", step, Step(None))], timing=FixedTiming(0.0, 0.0)) as url:
        stream = await _stream(make_client(url), "replay:m:0")
        with anyio.fail_after(10), pytest.raises(ToolCallError, match=message) as info:
            async for _ in tap_openai_stream(stream, TOOLS):
                pass
    assert info.value.tool_name == step.tool


async def test_tee_keeps_the_callers_loop(make_client: Any) -> None:
    async with replay_server([TWO_CALLS], timing=FixedTiming(0.0, 0.0)) as url:
        stream = await _stream(make_client(url), "replay:two:0")
        events: list[Any] = []
        chunks = []
        async for chunk in tee_openai_stream(stream, TOOLS, events.append):  # the caller's loop, unchanged
            chunks.append(chunk)
    assert all(type(c).__name__ == "ChatCompletionChunk" for c in chunks)
    assert isinstance(events[-1], MessageFinished) and len(events[-1].tool_calls) == 2


async def test_cancel_closes_the_stream(make_client: Any) -> None:
    async with replay_server([TWO_CALLS], timing=FixedTiming(0.0, 0.5)) as url:
        stream = await _stream(make_client(url), "replay:two:0")
        with anyio.move_on_after(0.3) as scope:
            async with tap_openai_stream(stream, TOOLS) as tap:
                async for _ in tap:
                    pass
        assert scope.cancelled_caught
        assert stream.response.is_closed


async def _aiter(items: list[Any]) -> Any:
    for item in items:
        yield item


async def test_responses_api_events() -> None:
    call = ResponseFunctionToolCall(arguments="", call_id="call_a", name="bash", type="function_call", id="fc_1")
    args = '{"command": "ls -la"}'
    usage = ResponseUsage.model_construct(input_tokens=10, output_tokens=5, total_tokens=15)
    items: list[Any] = [
        ResponseTextDeltaEvent(
            content_index=0, delta="Looking.", item_id="m1", logprobs=[], output_index=0, sequence_number=1,
            type="response.output_text.delta",
        ),
        ResponseOutputItemAddedEvent(item=call, output_index=1, sequence_number=2, type="response.output_item.added"),
        *[
            ResponseFunctionCallArgumentsDeltaEvent(
                delta=args[i : i + 5], item_id="fc_1", output_index=1, sequence_number=3 + i,
                type="response.function_call_arguments.delta",
            )
            for i in range(0, len(args), 5)
        ],
        ResponseFunctionCallArgumentsDoneEvent(
            arguments=args, item_id="fc_1", output_index=1, sequence_number=90, name="bash",
            type="response.function_call_arguments.done",
        ),
        ResponseCompletedEvent(
            response=Response.model_construct(usage=usage), sequence_number=91, type="response.completed"
        ),
    ]  # fmt: skip
    events = [e async for e in tap_openai_stream(_aiter(items), TOOLS)]
    names = [type(e).__name__ for e in events]
    # Complete right after the last delta, before the SDK's own "done" event is even looked at.
    assert names.index("ArgumentsComplete") == max(i for i, n in enumerate(names) if n == "ArgumentsDelta") + 1
    finished = next(e for e in events if isinstance(e, MessageFinished))
    assert finished.content == "Looking." and finished.finish_reason == "tool_calls"
    assert finished.tool_calls[0].id == "call_a" and finished.tool_calls[0].arguments == {"command": "ls -la"}
    assert isinstance(events[-1], UsageReported) and events[-1].usage.total_tokens == 15
    assert isinstance(events[1], ToolNameKnown)


def test_tap_quirks_without_a_server() -> None:
    """Text between calls, deltas without ``index`` (matched by id), name and arguments in one delta, empty
    arguments for a parameterless tool, and a stream that ends before finish_reason."""
    from bunshin_async import LLMStreamError
    from bunshin_async.llm import ToolCallTap

    tap = ToolCallTap({"bash": {"type": "object", "required": ["command"]}, "noop": {"type": "object"}})
    events = tap.text("a")
    events += tap.tool_delta(None, "c1", "bash", '{"command":')
    events += tap.text(" between ")
    events += tap.tool_delta(None, "c1", None, '"ls"}')
    events += tap.tool_delta(None, "c2", "noop", None)
    events += tap.finish("tool_calls")
    assert [type(e).__name__ for e in events] == [
        "TextDelta", "ToolNameKnown", "ArgumentsDelta", "TextDelta", "ArgumentsDelta", "ArgumentsComplete",
        "ToolNameKnown", "ArgumentsComplete", "MessageFinished",
    ]  # fmt: skip
    finished = events[-1]
    assert isinstance(finished, MessageFinished)
    assert finished.content == "a between "
    assert [(c.id, c.arguments) for c in finished.tool_calls] == [("c1", {"command": "ls"}), ("c2", {})]
    cut = ToolCallTap({"bash": {}})
    cut.tool_delta(0, "x", "bash", '{"comm')
    with pytest.raises(LLMStreamError, match="before the message finished"):
        cut.end()


async def test_chat_client_cancel_closes_the_connection() -> None:
    from bunshin_async.llm import ChatClient, ReplayServer

    async with ReplayServer([TWO_CALLS], timing=FixedTiming(0.0, 0.5)) as server:
        async with ChatClient(server.base_url, "k") as client:
            stream = client.stream(model="replay:two:0", messages=[{"role": "user", "content": "go"}], tools=TOOLS)
            with anyio.move_on_after(0.3) as scope:
                async with stream:
                    async for _ in stream:
                        pass
            assert scope.cancelled_caught
            assert stream._response is None  # closed and released
            # The pool still works afterwards.
            server.timing = FixedTiming(0.0, 0.0)
            done = await client.complete(
                model="replay:two:0", messages=[{"role": "user", "content": "go"}], tools=TOOLS
            )
            assert len(done.tool_calls) == 2


ONE_CALL = traj("one", Step("bash", {"command": "make test"}, llm_seconds=0.3), Step(None, assistant_text="done"))


@pytest.mark.parametrize("separate", [False, True])
async def test_the_closing_brace_before_finish_when_asked(make_client: Any, separate: bool) -> None:
    """With ``separate_finish`` or without, the tap completes the call before the message ends (as on real
    endpoints): the closing brace's fragment is tapped before ``finish_reason``. How the server groups them into
    writes: ``test_the_closing_brace_gets_its_own_write_when_asked``."""
    async with replay_server([ONE_CALL], timing=FixedTiming(ttft=0.05, itl=0.15), separate_finish=separate,
                             preamble="Running the tests.") as url:  # fmt: skip
        stream = await _stream(make_client(url), "replay:one:0")
        async with tap_openai_stream(stream, TOOLS) as tap:
            events = [e async for e in tap]
    complete = next(e for e in events if isinstance(e, ArgumentsComplete))
    finished = next(e for e in events if isinstance(e, MessageFinished))
    assert finished.content == "Running the tests."  # the preamble streams before the call
    assert events.index(complete) < events.index(finished)


class _Writes:
    """A responder that records the writes a stream makes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def send(self, data: bytes) -> None:
        self.writes.append(data)

    async def end(self) -> None:
        pass


@pytest.mark.parametrize("separate", [False, True])
async def test_the_closing_brace_gets_its_own_write_when_asked(separate: bool) -> None:
    """Every token already due (a host that fell behind its schedule): the server coalesces them into one write,
    the tail (``finish_reason``) included; with ``separate_finish`` the last fragment (a call's closing brace) and
    the tail each get a write of their own."""
    server = ReplayServer([], timing=FixedTiming(), separate_finish=separate)
    rendered = Rendered(tokens=[b"a", b"b", b"}"], tail=b"[finish]", body=b"")
    writes = _Writes()
    await server._stream(writes, rendered, [0.0, 0.0, 0.0], anyio.current_time() - 60, None)  # type: ignore[arg-type]
    assert writes.writes == ([b"ab", b"}", b"[finish]"] if separate else [b"ab}[finish]"])


async def test_responses_api_through_the_replay_server(make_client: Any) -> None:
    """The Responses API served by the replay server, consumed with the SDK's ``client.responses`` and tapped:
    text, two calls in one message (the first complete while the second streams), usage, then the next turn
    matched from ``function_call``/``function_call_output`` input items; not streamed too."""
    async with replay_server([TWO_CALLS], timing=FixedTiming(ttft=0.02, itl=0.01), separate_finish=True) as url:
        client = make_client(url)
        stream = await client.responses.create(model="replay:two:0", input="go", tools=RESPONSES_TOOLS, stream=True)
        async with tap_openai_stream(stream, RESPONSES_TOOLS) as tap:
            events = [e async for e in tap]
        finished = next(e for e in events if isinstance(e, MessageFinished))
        assert finished.content == "First I look, then I read." and finished.finish_reason == "tool_calls"
        assert [(c.name, c.arguments) for c in finished.tool_calls] == [
            ("bash", TRICKY), ("read", {"path": "src/x.py", "max_lines": 40})]  # fmt: skip
        kinds = [(type(e).__name__, getattr(getattr(e, "call", e), "index", None)) for e in events]
        assert kinds.index(("ArgumentsComplete", 0)) < kinds.index(("ToolNameKnown", 1))
        assert kinds.index(("ArgumentsComplete", 1)) < kinds.index(("MessageFinished", None))
        assert isinstance(events[-1], UsageReported) and events[-1].usage.total_tokens > 0
        history: list[Any] = [{"role": "user", "content": "go"},
                              {"type": "message", "role": "assistant",
                               "content": [{"type": "output_text", "text": finished.content}]}]  # fmt: skip
        for c in finished.tool_calls:
            history.append({"type": "function_call", "call_id": c.id, "name": c.name, "arguments": c.raw})
        for c in finished.tool_calls:
            history.append({"type": "function_call_output", "call_id": c.id, "output": "ok"})
        last = await client.responses.create(model="replay:two:0", input=history, tools=RESPONSES_TOOLS)
        assert last.output_text == "done" and last.status == "completed"
        with pytest.raises(openai.BadRequestError, match="prefix mismatch"):
            wrong = {"type": "function_call", "call_id": "x", "name": "bash", "arguments": '{"command": "ls"}'}
            await client.responses.create(model="replay:two:0", input=[*history[:2], wrong])


RESPONSES_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS
]
