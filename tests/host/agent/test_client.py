"""The host's bounds on agent answers (``_client.answer_limit``) and its hang-ups (``AgentClient.quiesce``): pure
logic on socket pairs, no workspace."""

from __future__ import annotations

import socket

import anyio
import pytest
from anyio.abc import SocketStream

from bunshin_async._host import _protocol as P
from bunshin_async._host._client import CONTROL_FRAME, FILE_DATA_MAX, LISTING_MAX, AgentClient, answer_limit

pytestmark = pytest.mark.unit


def test_an_answer_is_bounded_by_what_its_request_can_return() -> None:
    assert answer_limit(P.ReadFile(path="x", max_bytes=10), 20) == CONTROL_FRAME + 20 + 10
    assert answer_limit(P.ReadFile(path="x"), 20) == CONTROL_FRAME + 20 + FILE_DATA_MAX
    assert answer_limit(P.ReadFile(path="x", max_bytes=1 << 40), 20) == CONTROL_FRAME + 20 + FILE_DATA_MAX
    assert answer_limit(P.ReadFile(path="x", max_bytes=-1), 20) == CONTROL_FRAME + 20
    # stdout and stderr, each up to max_output bytes, each byte up to 3 as UTF-8 with replacement
    assert answer_limit(P.Exec(argv=["x"], max_output=1000), 30) == CONTROL_FRAME + 30 + 6000
    assert answer_limit(P.ShellRun(shell_id=1, command="x", max_output=0), 30) == CONTROL_FRAME + 30
    assert answer_limit(P.ListDir(path="."), 10) == CONTROL_FRAME + 10 + LISTING_MAX
    assert answer_limit(P.Ping(), 10) == CONTROL_FRAME + 10
    assert answer_limit(P.WriteFile(path="x", data=b"y" * 100), 10) == CONTROL_FRAME + 10


async def test_quiesce_hangs_up_every_idle_connection_at_once() -> None:
    """An agent that closes its ends once all the host's have hung up (its threads each wait on another): hung up
    in turn, the first waited for an end-of-file that never came (``HANG_UP_GRACE``, then each other one: all
    counted as closed unseen); at once, every end-of-file comes."""
    pairs = [socket.socketpair() for _ in range(3)]
    client = AgentClient(0, -1, "ws")
    client._idle = [await SocketStream.from_socket(ours) for ours, _ in pairs]
    theirs = [await SocketStream.from_socket(t) for _, t in pairs]

    async def agent() -> None:
        for conn in theirs:  # every hang-up first
            with pytest.raises(anyio.EndOfStream):
                await conn.receive()
        for conn in theirs:
            await conn.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(agent)
        await client.quiesce()
    assert client.all_closed()


async def test_a_pid_span_is_adopted_only_through_the_clients_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A served sibling's read moves the pid cursor (``PidLedger.adopt``, a helper in the workspace's pid namespace):
    as a request would, it waits while a snapshot has quiesced the client, and a snapshot's drain waits for one under
    way, so the cursor never moves while CRIU dumps the tree."""
    client = AgentClient(0, -1, "ws")
    adopted: list[tuple[int, int]] = []
    release = anyio.Event()

    async def adopt(before: int, after: int) -> None:
        adopted.append((before, after))
        await release.wait()

    monkeypatch.setattr(client.pids, "adopt", adopt)
    await client.quiesce()
    quiesced = anyio.Event()

    async def quiesce() -> None:
        await client.quiesce()
        quiesced.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(client.adopt_pids, 10, 12)
        await anyio.wait_all_tasks_blocked()
        assert adopted == []  # held by the snapshot's quiesce
        client.resume()
        await anyio.wait_all_tasks_blocked()
        assert adopted == [(10, 12)]
        tg.start_soon(quiesce)  # a snapshot starts while the cursor moves
        await anyio.wait_all_tasks_blocked()
        assert not quiesced.is_set()
        release.set()
    assert quiesced.is_set()
    assert not client.quiet_since((0, 0))  # the cursor moved: a check made before it no longer holds
