"""Fixtures for the cache tests: real workspaces (with a leak check) and a real redis-server of our own."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from bunshin_async import Workspace

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server on a loopback port, its data (AOF) in a directory of its own, so a restart keeps it."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.dir),
                "--appendonly", "yes",
                "--appendfsync", "always",
                "--save", "",
                "--protected-mode", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis flushes the AOF and exits
            self.proc.wait(10)
        self.proc = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    assert os.path.exists(REDIS_SERVER), "redis-server is not installed: run `make setup`"
    with tempfile.TemporaryDirectory(prefix="bunshin-redis-") as d:
        server = RedisServer(Path(d))
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server this test may stop and start."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _need_workspaces() -> None:
    assert os.geteuid() == 0, "workspaces need root"


@pytest.fixture
async def workspace() -> AsyncIterator[Workspace]:
    """A real workspace (the session-wide ``no_leaks`` fixture checks nothing of it is left)."""
    _need_workspaces()
    async with Workspace() as ws:
        yield ws


@pytest.fixture
def need_workspaces() -> None:
    _need_workspaces()
