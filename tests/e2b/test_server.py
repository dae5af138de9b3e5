"""``E2BServer``'s own start: one that fails (the port taken, uvicorn refusing to start) or is cancelled leaves
nothing (socket, task, thread, descriptor) and says why with a ``ServeError``. No workspace is made: the server's
backend makes none before a sandbox is asked for."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import uvicorn

from bunshin_async import InvalidArgument, ServeError
from bunshin_async.integrations.e2b import E2BServer

pytestmark = pytest.mark.unit


def _fds() -> set[str]:
    return {f"{fd} {os.readlink(f'/proc/self/fd/{fd}')}" for fd in os.listdir("/proc/self/fd") if _alive(fd)}


def _alive(fd: str) -> bool:
    try:
        os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor
        return False
    return True


class State:
    """What this process holds: descriptors, threads and the event loop's tasks."""

    def __init__(self) -> None:
        self.fds = _fds()
        self.threads = {t.ident for t in threading.enumerate()}
        self.tasks = {t.id for t in anyio.get_running_tasks()}

    def added(self) -> dict[str, Any]:
        now = State()
        return {
            "fds": now.fds - self.fds,
            "threads": now.threads - self.threads,
            "tasks": now.tasks - self.tasks,
        }


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def _free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def test_a_taken_port_is_a_serve_error_and_leaves_nothing(taken_port: int) -> None:
    before = State()
    server = E2BServer(port=taken_port)
    with pytest.raises(ServeError, match="the port is taken") as failed:
        await server.__aenter__()
    assert failed.value.address == f"http://127.0.0.1:{taken_port}"
    assert before.added() == {"fds": set(), "threads": set(), "tasks": set()}
    await server.aclose()  # idempotent after a failed start


async def test_an_http_server_that_fails_to_start_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    async def startup(self: uvicorn.Server, sockets: Any = None) -> None:
        sys.exit(3)  # what uvicorn does when its start fails (a lifespan or a listener that fails)

    monkeypatch.setattr(uvicorn.Server, "startup", startup)
    before = State()
    server = E2BServer()
    with pytest.raises(ServeError, match="did not start: SystemExit") as failed:
        await server.__aenter__()
    port = int(failed.value.address.rpartition(":")[2])
    assert port and _free(port)  # its socket is closed
    assert before.added() == {"fds": set(), "threads": set(), "tasks": set()}
    assert server._tg is None and server._sock is None


async def test_a_start_cancelled_midway_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    reached = anyio.Event()

    async def startup(self: uvicorn.Server, sockets: Any = None) -> None:
        reached.set()
        await anyio.sleep_forever()  # a start that does not come: the caller gives up

    monkeypatch.setattr(uvicorn.Server, "startup", startup)
    before = State()
    server = E2BServer()
    async with anyio.create_task_group() as tg:

        async def start() -> None:
            await server.__aenter__()
            raise AssertionError("the start was not cancelled")

        tg.start_soon(start)
        await reached.wait()
        tg.cancel_scope.cancel()
    assert _free(server.port)
    assert before.added() == {"fds": set(), "threads": set(), "tasks": set()}
    assert server._tg is None and server._sock is None


def test_a_port_out_of_range_is_refused_at_once() -> None:
    with pytest.raises(InvalidArgument, match="not a TCP port"):
        E2BServer(port=70000)


async def test_a_server_that_started_serves_and_closes_whole() -> None:
    before = State()
    async with E2BServer() as server:
        port = server.port
        async with await anyio.connect_tcp("127.0.0.1", port) as conn:
            await conn.send(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await conn.receive()).startswith(b"HTTP/1.1 502")  # no sandbox named
    assert _free(port)
    assert before.added() == {"fds": set(), "threads": set(), "tasks": set()}
