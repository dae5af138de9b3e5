"""Which recorded turn answers a request: ``build_turns`` and ``match_turn`` over plain data (no server)."""

from __future__ import annotations

from typing import Any

import pytest

from bunshin_async._llm._responses import ResponsesRequest, responses_messages
from bunshin_async._llm._turns import ReplayError, build_turns, match_turn, token_pieces
from bunshin_async._llm._wire import ChatMessage, FunctionCall, WireToolCall
from bunshin_async.rollout import Step, Trajectory

pytestmark = pytest.mark.unit

TRAJ = Trajectory(
    task_id="t",
    steps=[
        Step("bash", {"command": "ls"}, llm_seconds=0.5, assistant_text="Looking.", turn=0, observation="a\n"),
        Step("read", {"path": "a"}, llm_seconds=0.25, turn=0, observation="x"),
        Step("format_error", None, llm_seconds=9.0, turn=1),  # no usable call: skipped
        Step("bash", {"command": "make"}, llm_seconds=1.0, turn=2, observation="ok"),
        Step(None, llm_seconds=0.1, assistant_text="Done."),
    ],
)


def _assistant(*calls: tuple[str, str], text: str = "", ids: tuple[str, ...] = ()) -> ChatMessage:
    tool_calls = [
        WireToolCall(ids[i] if ids else f"c{i}", "function", FunctionCall(name, args))
        for i, (name, args) in enumerate(calls)
    ]
    return ChatMessage(role="assistant", content=text or None, tool_calls=tool_calls or None)


def _tool(call_id: str, content: str) -> ChatMessage:
    return ChatMessage(role="tool", tool_call_id=call_id, content=content)


USER = ChatMessage(role="user", content="fix it")
FIRST = _assistant(("bash", '{"command": "ls"}'), ("read", '{"path":"a"}'), text="Looking.")


def test_steps_group_into_turns() -> None:
    turns = build_turns(TRAJ)
    assert [[c.name for c in t.calls] for t in turns] == [["bash", "read"], ["bash"], []]
    assert [t.final for t in turns] == [False, False, True]
    assert turns[0].llm_seconds == 0.75  # a turn's calls' LLM times add up
    assert turns[0].text == "Looking." and turns[2].text == "Done."
    assert turns[1].calls[0].raw == '{"command":"make"}' and turns[1].calls[0].args == {"command": "make"}


def test_the_next_turn_answers_a_matching_prefix() -> None:
    turns = build_turns(TRAJ)
    assert match_turn("t:0", turns, [USER], "skeleton") == 0
    # skeleton: names and arguments (as JSON, so spacing does not matter); texts and observations may differ
    other_text = _assistant(("bash", '{"command":"ls"}'), ("read", '{"path": "a"}'), text="Something else.")
    messages = [USER, other_text, _tool("c0", "different"), _tool("c1", "also")]
    assert match_turn("t:0", turns, messages, "skeleton") == 1
    second = _assistant(("bash", '{"command":"make"}'))
    assert match_turn("t:0", turns, [*messages, second, _tool("c0", "ok")], "skeleton") == 2


@pytest.mark.parametrize(
    ("messages", "code", "says"),
    [
        ([USER, _assistant(("bash", '{"command":"pwd"}'))], "replay_prefix_mismatch", 'bash({"command":"pwd"})'),
        ([USER, _assistant()], "replay_prefix_mismatch", "no tool call"),
        ([USER, FIRST, _assistant(("bash", '{"command":"make"}')), _assistant()], "replay_past_end", "ended"),
    ],
)
def test_a_request_that_left_the_recording_is_refused(messages: list[ChatMessage], code: str, says: str) -> None:
    with pytest.raises(ReplayError) as info:
        match_turn("t:0", build_turns(TRAJ), messages, "skeleton")
    assert (info.value.status, info.value.code) == (400, code) and says in info.value.message


def test_exact_also_compares_texts_and_observations() -> None:
    turns = build_turns(TRAJ)
    ok = [USER, FIRST, _tool("c0", "a\n"), _tool("c1", "x")]
    assert match_turn("t:0", turns, ok, "exact") == 1
    cases: list[tuple[list[ChatMessage], str]] = [
        ([USER, _assistant(*[("bash", '{"command":"ls"}'), ("read", '{"path":"a"}')], text="Hm."), *ok[2:]], "text"),
        ([USER, FIRST, _tool("c0", "a\n")], "no tool result for call 'c1'"),
        ([USER, FIRST, _tool("c0", "b\n"), _tool("c1", "x")], "differs from the recorded observation"),
    ]
    for messages, says in cases:
        with pytest.raises(ReplayError, match=says):
            match_turn("t:0", turns, messages, "exact")
    # a turn recorded without text matches the preamble the server streamed in its place
    bare = build_turns(Trajectory("u", steps=[Step("bash", {"command": "ls"}), Step(None)]))
    said = [USER, _assistant(("bash", '{"command":"ls"}'), text="Let me look."), _tool("c0", "anything")]
    assert match_turn("u:0", bare, said, "exact", preamble="Let me look.") == 1


def test_responses_input_reads_as_chat_messages() -> None:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c0", "name": "bash", "arguments": '{"command":"ls"}'},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"path":"a"}'},
        {"type": "function_call_output", "call_id": "c0", "output": "a\n"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
    ]
    messages = responses_messages(ResponsesRequest(model="replay:t", input=items, instructions="be brief"))
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [tc.id for tc in messages[2].tool_calls or []] == ["c0", "c1"]  # the calls join the assistant's message
    assert match_turn("t:0", build_turns(TRAJ), messages, "exact") == 1
    with pytest.raises(ValueError, match="not supported"):
        responses_messages(ResponsesRequest(model="m", input=[{"type": "image_generation_call"}]))


def test_text_is_streamed_in_small_pieces_that_add_up() -> None:
    text = 'cd /testbed && python -m pytest -q  "tests/a b.py"'
    parts = token_pieces(text)
    assert "".join(parts) == text and all(len(p.strip()) <= 6 for p in parts) and len(parts) > 8
