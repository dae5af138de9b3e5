"""Speculation tests: real workspaces and forks (CRIU), scripted turns served by the real replay server over
loopback and consumed with the real ``openai`` SDK. After every test no snapshot or child process may be left."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import openai
import psutil
import pytest

_SNAPDIR = tempfile.mkdtemp(prefix="bunshin-snap-spec-", dir="/dev/shm")
os.environ["BUNSHIN_SNAPDIR"] = _SNAPDIR

from bunshin_async._fork._layers import prepare_snapshot_store  # noqa: E402
from bunshin_async._paths import criu_binary  # noqa: E402
from bunshin_async.llm import RecordedTiming, ReplayServer  # noqa: E402
from bunshin_async.rollout import Step, Trajectory  # noqa: E402

pytestmark = pytest.mark.root

# Tests of the runtime's mechanics give CostAwarePolicy contention=None: how busy this shared machine's CPUs are is
# not what they test (test_lead_time.py tests the back-off under a full CPU).

assert os.geteuid() == 0 and criu_binary() is not None, "speculation tests need root and CRIU: run `make setup`"
prepare_snapshot_store()


def _children() -> list[str]:
    return [f"{p.pid} {p.name()} {p.status()}" for p in psutil.Process().children(recursive=True)]


@pytest.fixture(autouse=True)
async def no_spec_leaks() -> AsyncIterator[None]:
    # Children alive before the test (tests/cache's session redis-server, when run together) are not its leaks.
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def left() -> list[str]:
        return [c for c in _children() if int(c.split()[0]) not in before]

    yield
    with anyio.move_on_after(3):
        while left() or any(Path(_SNAPDIR).iterdir()):
            await anyio.sleep(0.02)
    assert not left(), f"child processes left: {left()}"
    assert not any(Path(_SNAPDIR).iterdir()), f"snapshots left: {list(Path(_SNAPDIR).iterdir())}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    subprocess.run(["umount", "--lazy", _SNAPDIR], check=False)
    shutil.rmtree(_SNAPDIR, ignore_errors=True)


def bash(command: str, *, llm: float = 0.03, turn: int | None = None, text: str = "") -> Step:
    return Step("bash", {"command": command}, llm_seconds=llm, turn=turn, assistant_text=text or None)


def final(llm: float = 0.02) -> Step:
    return Step(None, None, llm_seconds=llm, assistant_text="done")


def trajectory(task: str, steps: Sequence[Step], rollout: int = 0) -> Trajectory:
    return Trajectory(task_id=task, rollout=rollout, steps=list(steps))


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    """``async with serve(trajectories) as client``: a replay server (recorded LLM time) and an openai client."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def run(trajs: Sequence[Trajectory], **options: Any) -> AsyncIterator[openai.AsyncOpenAI]:
        options.setdefault("timing", RecordedTiming(ttft=0.01))
        async with ReplayServer(list(trajs), **options) as server:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            try:
                yield client
            finally:
                await client.close()

    yield run
