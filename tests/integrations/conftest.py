"""Fixtures of the integration tests: the environment a server subprocess needs to use this run's directories."""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable

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
