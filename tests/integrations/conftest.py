"""Fixtures of the integration tests: the environment a server subprocess needs to use this run's directories."""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from tests._leaks import children, leftovers


def bunshin_env() -> dict[str, str]:
    """``BUNSHIN_*`` of this test run (its rundir, snapshot dir, cgroup parent) and ``PATH``: a server started as
    a subprocess makes its workspaces where the leak check looks."""
    env = {k: v for k, v in os.environ.items() if k.startswith("BUNSHIN_")}
    env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Clean = Callable[..., Awaitable[None]]


@pytest.fixture
def clean() -> Clean:
    """``await clean(grace=...)``: assert, mid-test, that nothing this test made is left (the autouse leak check
    runs after the test; this one may wait longer, for a server subprocess to stop). Child processes that ran
    before the test (a session's redis-server) are not the test's."""
    before = children()

    async def check(grace: float = 3.0) -> None:
        left = await leftovers(grace=grace, ignore_children=before)
        assert not left, f"left behind: {left}"

    return check


ROOT = Path(__file__).resolve().parents[2]


async def run_suite(
    python: Path, suite: str, *, made_by: str, skips_ok: bool = False, pytest_args: tuple[str, ...] = ()
) -> None:
    """Run ``tests/integrations/<suite>`` with another environment's ``python`` (a framework the main venv cannot
    hold; ``made_by`` is the script that builds it) and fail with its output if it fails. The suite's own
    conftest gives it its own rundir, snapshot dir and cgroup parent, as this run has."""
    assert python.exists(), f"{python} is missing: run `make setup` ({made_by})"
    argv = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    argv.append(str(Path(__file__).with_name(suite)))
    mine = ("BUNSHIN_RUNDIR", "BUNSHIN_SNAPDIR", "BUNSHIN_CGROUP_PARENT")
    env = {k: v for k, v in os.environ.items() if k not in mine}
    proc = await anyio.run_process(argv, cwd=ROOT, env=env, check=False)
    out = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, out[-8000:]
    last = out.splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last)}
    assert counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("errors"), out[-2000:]
    assert skips_ok or not counts.get("skipped"), out[-2000:]
    sys.stdout.write(last + "\n")
