"""Errors, retries and bad input: every one ends in a clear error or a successful retry, never a hang."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import httpx
import openai
import pytest

from bunshin_async import LLMConnectionError, LLMHTTPError, LLMStreamError
from bunshin_async.llm import (
    ChatClient,
    FixedTiming,
    MessageFinished,
    ReplayServer,
    RetryPolicy,
    replay_server,
    tap_openai_stream,
)
from bunshin_async.rollout import Step

from .conftest import TOOLS, traj

pytestmark = pytest.mark.unit

FAST = RetryPolicy(max_retries=3, backoff=0.01, max_backoff=0.05)
MSGS = [{"role": "user", "content": "go"}]


def _faulty(fault: str, times: int | None = None) -> Any:
    return traj("f", Step("bash", {"command": "ls -la /tmp"}, fault=fault, fault_times=times), Step(None))  # type: ignore[arg-type]


@pytest.mark.parametrize("fault", ["http_500", "http_503", "http_429"])
async def test_client_retries_then_succeeds(fault: str) -> None:
    async with ReplayServer([_faulty(fault, 2)], timing=FixedTiming(0.0, 0.0)) as server:
        async with ChatClient(server.base_url, "k", retry=FAST) as client:
            with anyio.fail_after(10):
                done = await client.complete(model="replay:f:0", messages=MSGS, tools=TOOLS)
    assert done.tool_calls[0].arguments == {"command": "ls -la /tmp"}
    assert server.requests == 3


async def test_client_gives_up_with_status() -> None:
    async with ReplayServer([_faulty("http_500")], timing=FixedTiming(0.0, 0.0)) as server:
        async with ChatClient(server.base_url, "k", retry=FAST) as client:
            with anyio.fail_after(10), pytest.raises(LLMHTTPError, match="injected 500") as info:
                await client.complete(model="replay:f:0", messages=MSGS, tools=TOOLS)
    assert info.value.status == 500 and server.requests == 4


async def test_client_connection_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        async with ChatClient(f"http://127.0.0.1:{port}/v1", "k", retry=FAST) as client:
            with anyio.fail_after(10), pytest.raises(LLMConnectionError, match="after 4 attempts"):
                await client.complete(model="m", messages=MSGS)


async def test_client_stream_cut() -> None:
    async with replay_server([_faulty("cut")], timing=FixedTiming(0.0, 0.01)) as url:
        async with ChatClient(url, "k", retry=FAST) as client:
            with anyio.fail_after(10), pytest.raises(LLMStreamError, match="cut mid-message"):
                await client.complete(model="replay:f:0", messages=MSGS, tools=TOOLS)


async def test_client_stream_stall_times_out() -> None:
    async with replay_server([_faulty("stall")], timing=FixedTiming(0.0, 0.01), stall_seconds=60) as url:
        timeout = httpx.Timeout(10.0, read=0.3)
        async with ChatClient(url, "k", retry=FAST, timeout=timeout) as client:
            with anyio.fail_after(10), pytest.raises(LLMStreamError, match="stalled"):
                await client.complete(model="replay:f:0", messages=MSGS, tools=TOOLS)


async def test_client_unknown_trajectory_and_mismatch() -> None:
    t = traj("t", Step("bash", {"command": "ls"}), Step(None, assistant_text="bye"))
    async with replay_server([t], timing=FixedTiming(0.0, 0.0)) as url:
        async with ChatClient(url, "k", retry=FAST) as client:
            with anyio.fail_after(10), pytest.raises(LLMHTTPError) as info:
                await client.complete(model="gpt-4o", messages=MSGS, tools=TOOLS)
            assert info.value.status == 404
            assert "model 'gpt-4o' names no trajectory" in str(info.value) and "replay:t:0" in str(info.value)
            wrong = [
                *MSGS,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "bash", "arguments": '{"command":"pwd"}'}}
                ]},
                {"role": "tool", "tool_call_id": "c", "content": "/"},
            ]  # fmt: skip
            with anyio.fail_after(10), pytest.raises(LLMHTTPError) as info:
                await client.complete(model="replay:t:0", messages=wrong, tools=TOOLS)
            assert info.value.status == 400
            assert 'at assistant turn 0 (messages[1]): the request has bash({"command":"pwd"})' in str(info.value)
            assert 'the recording has bash({"command":"ls"})' in str(info.value)
            # Observations may differ in skeleton mode; the header selects the trajectory too.
            right = [*wrong[:1], {**wrong[1], "tool_calls": [{**wrong[1]["tool_calls"][0], "function": {
                "name": "bash", "arguments": '{"command": "ls"}'}}]}, wrong[2]]  # fmt: skip
            async with ChatClient(url, "k", retry=FAST, headers={"X-Replay-Trajectory": "t"}) as by_header:
                done = await by_header.complete(model="anything", messages=right, tools=TOOLS)
                assert done.finish_reason == "stop" and done.content == "bye"
                past = [*right, {"role": "assistant", "content": "bye"}, {"role": "user", "content": "?"}]
                with pytest.raises(LLMHTTPError, match="ended the conversation") as info:
                    await by_header.complete(model="x", messages=past)
            assert info.value.status == 400


# --------------------------------------------------------------------------------------------- the openai SDK


async def test_openai_sdk_errors(make_client: Any) -> None:
    t = traj("t", Step("bash", {"command": "ls"}), Step(None))
    async with replay_server([t, _faulty("http_500", 1)], timing=FixedTiming(0.0, 0.0)) as url:
        client = make_client(url, max_retries=2)
        with anyio.fail_after(20):
            with pytest.raises(openai.NotFoundError, match="names no trajectory"):
                await client.chat.completions.create(model="nope", messages=MSGS, tools=TOOLS)
            bad = [*MSGS, {"role": "assistant", "content": "hm"}]
            with pytest.raises(openai.BadRequestError, match="prefix mismatch"):
                await client.chat.completions.create(model="replay:t:0", messages=bad, tools=TOOLS)
            # One injected 500: the SDK's own retry gets the turn.
            stream = await client.chat.completions.create(model="replay:f:0", messages=MSGS, tools=TOOLS, stream=True)
            events = [e async for e in tap_openai_stream(stream, TOOLS)]
            assert isinstance(events[-1], MessageFinished)


@pytest.mark.parametrize("fault", ["cut", "stall"])
async def test_openai_sdk_stream_failures(make_client: Any, fault: str) -> None:
    async with replay_server([_faulty(fault)], timing=FixedTiming(0.0, 0.01), stall_seconds=60) as url:
        client = make_client(url, max_retries=0, timeout=httpx.Timeout(10.0, read=0.3))
        stream = await client.chat.completions.create(model="replay:f:0", messages=MSGS, tools=TOOLS, stream=True)
        with anyio.fail_after(10), pytest.raises(LLMStreamError, match="failed mid-message"):
            async for _ in tap_openai_stream(stream, TOOLS):
                pass
