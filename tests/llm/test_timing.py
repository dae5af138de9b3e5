"""Pacing: replayed turns take the recorded LLM time end to end, also under concurrency."""

from __future__ import annotations

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


async def _timed_turn(client: Any, model: str, hold: AllOpen | None = None) -> tuple[float, float, float]:
    """When one streamed turn was requested, its first event came and its MessageFinished came (monotonic); with
    ``hold``, the stream is read on from its first event once every stream of the hold has had its own."""
    start = time.monotonic()
    stream = await client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, stream=True)
    first = None
    async with tap_openai_stream(stream, TOOLS) as tap:
        async for event in tap:
            if first is None:
                first = event.t
                if hold is not None:
                    await hold.wait()
            if isinstance(event, MessageFinished):
                end = event.t
    assert first is not None
    return start, first, end


class AllOpen:
    """A barrier: each caller waits until ``n`` have come (a hang guard bounds it): whoever waits here is open at
    the same time as the ``n - 1`` others, whatever the machine's speed; one served after another never get there."""

    def __init__(self, n: int) -> None:
        self.n, self.came, self._all = n, 0, anyio.Event()

    async def wait(self) -> None:
        self.came += 1
        if self.came == self.n:
            self._all.set()
        with anyio.fail_after(60):
            await self._all.wait()


# Pacing is asserted as what a loaded machine cannot change: a turn never ends before its recorded time and its
# first event comes before its end; concurrency as a count (how many turns were being streamed at once).
# How close to the recorded time turns end on a given machine is for the benchmark to report (`server.max_lag`).
EARLY = 0.005
"""Slack for the float arithmetic of the schedule (both ends read CLOCK_MONOTONIC)."""


async def test_recorded_two_seconds(make_client: Any) -> None:
    t = traj("slow", Step("bash", COMMAND, llm_seconds=2.0, assistant_text="Running the tests now."), Step(None))
    async with replay_server([t], timing=RecordedTiming(ttft=0.3)) as url:
        with anyio.fail_after(10):
            start, first, end = await _timed_turn(make_client(url), "replay:slow:0")
    ttft, total = first - start, end - start
    print(f"recorded 2 s turn: ttft {ttft:.3f} s, end to end {total:.3f} s")
    assert 0.3 - EARLY <= ttft < total and total >= 2.0 - EARLY


async def test_non_streaming_recorded(make_client: Any) -> None:
    t = traj("slow", Step("bash", COMMAND, llm_seconds=0.5), Step(None))
    async with replay_server([t], timing=RecordedTiming()) as url:
        client = make_client(url)
        start = time.monotonic()
        done = await client.chat.completions.create(model="replay:slow:0", messages=MSGS, tools=TOOLS)
        took = time.monotonic() - start
    assert took >= 0.5 - EARLY
    assert done.choices[0].message.tool_calls[0].function.arguments == '{"command":"' + COMMAND["command"] + '"}'


async def _concurrent(label: str, n: int, run_one: Any) -> None:
    """``n`` turns of ``ONE_SECOND`` at once (``run_one`` returns when a turn was requested, started and ended; it
    holds each turn at an ``AllOpen`` of ``n``, so all ``n`` are open at once or none ends): each paced (never
    early). How far apart they ended on this machine is printed, not asserted."""
    turns: list[tuple[float, float, float]] = []

    async def one() -> None:
        turns.append(await run_one())

    start = time.monotonic()
    with anyio.fail_after(120):  # a hang guard
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
    wall = time.monotonic() - start
    ends = sorted(end - request for request, _, end in turns)
    print(f"{label}: end min {ends[0]:.3f} median {ends[n // 2]:.3f} max {ends[-1]:.3f} wall {wall:.3f}")
    assert len(turns) == n
    assert ends[0] >= 1.0 - EARLY  # paced: never early


ONE_SECOND = traj(
    "c", Step("bash", COMMAND, llm_seconds=1.0, assistant_text="Let me run the failing test."), Step(None)
)


class HeldReplayServer(ReplayServer):
    """The real server with each stream held before its first token until ``hold``'s ``n`` streams are inside it
    (injects a wait only): a server that served one stream after another would never let the first go on."""

    hold: AllOpen

    async def _stream(self, *args: Any, **kwargs: Any) -> None:
        await self.hold.wait()
        await super()._stream(*args, **kwargs)


async def test_64_concurrent_streams_in_process() -> None:
    """Server and our httpx client share one event loop (and, with the other tests, the host's 2 cores); the
    server holds each stream until all 64 are open in it."""
    async with HeldReplayServer([ONE_SECOND], timing=RecordedTiming(ttft=0.2)) as server:
        server.hold = AllOpen(64)
        async with ChatClient(server.base_url, "k") as client:

            async def run_one() -> tuple[float, float, float]:
                start = time.monotonic()
                first = None
                async with client.stream(model="replay:c:0", messages=MSGS, tools=TOOLS) as stream:
                    async for event in stream:
                        first = first or event.t
                        if isinstance(event, MessageFinished):
                            return start, first, event.t
                raise AssertionError("no MessageFinished")

            await _concurrent("64 streams, in-process server + ChatClient", 64, run_one)
    assert server.hold.came == 64
    print(f"server max token lag {server.max_lag * 1000:.1f} ms")


async def test_64_concurrent_openai_streams_cli_server(tmp_path: Path, make_client: Any) -> None:
    """The ``bunshin replay-server`` process against one ``openai.AsyncOpenAI`` with 64 streams at once (the SDK
    parses each chunk into pydantic models, so the client side is the heavy one): each stream is read on from its
    first event once all 64 have had theirs (the server itself held in the test above)."""
    path = dump_trajectories(tmp_path / "t.jsonl.gz", [ONE_SECOND])
    argv = [sys.executable, "-m", "bunshin_async", "replay-server", "--trajectories", str(path)]
    argv += ["--port", "0", "--time-model", "recorded", "--ttft", "0.2"]
    async with await anyio.open_process(argv) as proc:
        try:
            assert proc.stdout is not None
            with anyio.fail_after(20):
                line = (await BufferedByteReceiveStream(proc.stdout).receive_until(b"\n", 4096)).decode()
            url = line.split()[3]
            assert line.startswith("replay server on http://127.0.0.1:") and "1 trajectories" in line
            client = make_client(url)
            await _timed_turn(client, "replay:c:0")  # warm-up: the SDK builds its response models lazily
            hold = AllOpen(64)

            async def run_one() -> tuple[float, float, float]:
                return await _timed_turn(client, "replay:c:0", hold)

            await _concurrent("64 streams, CLI server + openai SDK", 64, run_one)
            assert hold.came == 64
        finally:
            proc.terminate()


@pytest.mark.unit
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
