"""Pacing: replayed turns take the recorded LLM time end to end, also under concurrency."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from bunshin_async._llm._timing import token_offsets
from bunshin_async.llm import (
    ChatClient,
    FixedTiming,
    LognormalTiming,
    MessageFinished,
    RecordedTiming,
    ReplayServer,
    replay_server,
    tap_openai_stream,
)
from bunshin_async.rollout import Step, dump_trajectories

from .conftest import TOOLS, traj

MSGS = [{"role": "user", "content": "go"}]
COMMAND = {"command": "cd /testbed && python -m pytest tests/test_separable.py -x -q 2>&1 | tail -20"}


async def _timed_turn(client: Any, model: str) -> tuple[float, float]:
    """(time to first event, time to MessageFinished) of one streamed turn, from just before the request."""
    start = time.monotonic()
    stream = await client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, stream=True)
    first = None
    async with tap_openai_stream(stream, TOOLS) as tap:
        async for event in tap:
            first = first or event.t
            if isinstance(event, MessageFinished):
                end = event.t
    assert first is not None
    return first - start, end - start


async def test_recorded_two_seconds(make_client: Any) -> None:
    t = traj("slow", Step("bash", COMMAND, llm_seconds=2.0, assistant_text="Running the tests now."), Step(None))
    async with replay_server([t], timing=RecordedTiming(ttft=0.3)) as url:
        with anyio.fail_after(10):
            ttft, total = await _timed_turn(make_client(url), "replay:slow:0")
    print(f"recorded 2 s turn: ttft {ttft:.3f} s, end to end {total:.3f} s")
    assert 1.8 <= total <= 2.2
    assert 0.25 <= ttft <= 0.45


async def test_non_streaming_recorded(make_client: Any) -> None:
    t = traj("slow", Step("bash", COMMAND, llm_seconds=0.5), Step(None))
    async with replay_server([t], timing=RecordedTiming()) as url:
        client = make_client(url)
        # Warm-up: the first call pays the SDK's connection and lazily built response models (~0.1-0.3 s here).
        await client.chat.completions.create(model="replay:slow:0", messages=MSGS, tools=TOOLS)
        start = time.monotonic()
        done = await client.chat.completions.create(model="replay:slow:0", messages=MSGS, tools=TOOLS)
        took = time.monotonic() - start
    assert 0.45 <= took <= 0.6
    assert done.choices[0].message.tool_calls[0].function.arguments == '{"command":"' + COMMAND["command"] + '"}'


async def _concurrent(n: int, run_one: Any) -> tuple[list[float], float]:
    totals: list[float] = []

    async def one() -> None:
        totals.append(await run_one())

    start = time.monotonic()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
    return sorted(totals), time.monotonic() - start


def _report(label: str, totals: list[float], wall: float) -> None:
    print(f"{label}: min {totals[0]:.3f} median {totals[len(totals) // 2]:.3f} max {totals[-1]:.3f} wall {wall:.3f}")


async def _all_within(
    label: str, run_one: Any, low: float = 0.85, high: float = 1.5, attempts: int = 3, overloaded_high: float = 2.5
) -> None:
    """64 concurrent turns must all end within [low, high] s: paced (never early) and concurrent (serialized they
    would take 64 s); how close to 1 s they end on a given machine is the benchmark's to report. The host is shared
    (other test suites run beside this one), so take the best of ``attempts`` rounds; if every round misses while
    the host is overloaded by others, the bound is ``overloaded_high``, and still never early."""
    rounds = []
    for _ in range(attempts):
        totals, wall = await _concurrent(64, run_one)
        _report(label, totals, wall)
        assert len(totals) == 64
        if low <= totals[0] and totals[-1] <= high:
            return
        rounds.append((totals[0], totals[-1]))
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) and any(low <= lo and hi <= overloaded_high for lo, hi in rounds):
        print(f"{label}: host overloaded (load {load:.1f}), a round within [{low}, {overloaded_high}] s: {rounds}")
        return
    raise AssertionError(f"{label}: no round within [{low}, {high}] s (load {load:.1f}): {rounds}")


ONE_SECOND = traj(
    "c", Step("bash", COMMAND, llm_seconds=1.0, assistant_text="Let me run the failing test."), Step(None)
)


async def test_64_concurrent_streams_in_process() -> None:
    """Server and our httpx client share one event loop (and, with the other tests, the host's 2 cores)."""
    async with ReplayServer([ONE_SECOND], timing=RecordedTiming(ttft=0.2)) as server:
        async with ChatClient(server.base_url, "k") as client:

            async def run_one() -> float:
                start = time.monotonic()
                async with client.stream(model="replay:c:0", messages=MSGS, tools=TOOLS) as stream:
                    async for event in stream:
                        if isinstance(event, MessageFinished):
                            return event.t - start
                raise AssertionError("no MessageFinished")

            await _all_within("64 streams, in-process server + ChatClient", run_one)
    print(f"server max token lag {server.max_lag * 1000:.1f} ms")


async def test_64_concurrent_openai_streams_cli_server(tmp_path: Path, make_client: Any) -> None:
    """The ``bunshin replay-server`` process against one ``openai.AsyncOpenAI`` with 64 streams at once (the SDK
    parses each chunk into pydantic models, so the client side is the heavy one)."""
    path = dump_trajectories(tmp_path / "t.jsonl.gz", [ONE_SECOND])
    argv = [sys.executable, "-m", "bunshin_async._cli", "replay-server", "--trajectories", str(path)]
    argv += ["--port", "0", "--time-model", "recorded", "--ttft", "0.2"]
    async with await anyio.open_process(argv) as proc:
        try:
            assert proc.stdout is not None
            with anyio.fail_after(20):
                line = (await BufferedByteReceiveStream(proc.stdout).receive_until(b"\n", 4096)).decode()
            url = line.split()[3]
            assert line.startswith("replay server on http://127.0.0.1:") and "1 trajectories" in line
            client = make_client(url)

            async def run_one() -> float:
                return (await _timed_turn(client, "replay:c:0"))[1]

            await _concurrent(64, run_one)  # warm-up: connections and the SDK's lazily built models
            # The SDK parses every chunk of 64 streams into pydantic models on one core of two: measured 1.04-1.17 s
            # on 2026-11-29 and 1.11-1.47 s on 2026-12-01 (load 1.2); 1.5 s still tells concurrent from serialized.
            await _all_within("64 streams, CLI server + openai SDK", run_one, high=1.5)
        finally:
            proc.terminate()


def test_timing_models() -> None:
    fixed = token_offsets(FixedTiming(ttft=0.5, itl=0.1), 3, 9.0, "k")
    assert fixed == pytest.approx([0.5, 0.6, 0.7])
    recorded = token_offsets(RecordedTiming(ttft=0.2), 5, 1.0, "k")
    assert recorded == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert token_offsets(RecordedTiming(ttft=0.2), 1, 1.0, "k") == [1.0]
    assert token_offsets(RecordedTiming(ttft=0.5), 3, 0.1, "k") == pytest.approx([0.1, 0.1, 0.1])
    assert token_offsets(RecordedTiming(fallback=FixedTiming(1.0, 0.0)), 2, None, "k") == [1.0, 1.0]
    model = LognormalTiming(ttft=0.5, itl=0.02, sigma=0.5, seed=7)
    a, b = token_offsets(model, 10, None, "t:0:1"), token_offsets(model, 10, None, "t:0:1")
    assert a == b  # seeded by the turn, not by request order
    assert token_offsets(model, 10, None, "t:0:2") != a
    draws = sorted(token_offsets(model, 1, None, f"k{i}")[0] for i in range(401))
    assert 0.4 < draws[200] < 0.6  # the median is the configured ttft
