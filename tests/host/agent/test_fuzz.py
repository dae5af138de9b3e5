"""Random, mutated and truncated frames sent straight to the agent's socket: every frame gets an answer that
decodes as a response (a ``protocol`` Failure exactly when msgspec's decoder of ``_protocol`` rejects the body too)
or the connection is closed, each within a time bound, and the agent serves on afterwards, the same process."""

from __future__ import annotations

import random
import socket
import struct
import time

import anyio
import msgspec
import pytest

from bunshin_async import Workspace
from bunshin_async._host import _protocol as P

STALL_SECONDS = 10  # agent.c: a peer silent this long in the middle of a frame is cut off
ANSWER_BOUND = 10.0
SAFE_OPS = ["ping", "read_file", "list_dir", "poll", "signal", "shell_run", "shell_close", "write_file", "remove"]
FIELDS = {
    "version": "int", "argv": "strlist", "command": "str", "cwd": "str", "env": "strmap", "stdin": "bytes",
    "timeout": "float", "max_output": "int", "user": "str", "shell_id": "int", "path": "str", "max_bytes": "int",
    "data": "bytes", "append": "bool", "mode": "int", "make_parents": "bool", "recursive": "bool",
    "log_path": "str", "pid": "int", "signal": "int",
}  # fmt: skip


def _rand_str(rng: random.Random) -> str:
    alphabet = "abc/._-~ \0\n'\"$é€😀\u2028"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))


def _rand_value(rng: random.Random, depth: int = 0) -> object:
    k = rng.randrange(9 if depth < 3 else 6)
    if k == 0:
        return None
    if k == 1:
        return rng.random() < 0.5
    if k == 2:
        return rng.choice([0, 1, -1, 7, 255, 65536, -(2**31), 2**63 - 1, -(2**63), 2**64 - 1, 2**32 + 3])
    if k == 3:
        return rng.choice([0.5, -1.0, 1e300, float("inf"), float("nan"), 3.0])
    if k == 4:
        return _rand_str(rng)
    if k == 5:
        return rng.randbytes(rng.randrange(16))
    if k == 6:
        return [_rand_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if k == 7:
        return {_rand_str(rng): _rand_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [_rand_str(rng) for _ in range(rng.randrange(4))]


def _typed_value(rng: random.Random, kind: str) -> object:
    return {
        "int": lambda: rng.choice([0, 1, 2, 5, -3, 10**12]),
        "float": lambda: rng.choice([0.5, 1, 2.5]),
        "bool": lambda: rng.random() < 0.5,
        "str": lambda: rng.choice(["f", "sub/g", "../x", "/workspace/h", "", "a\0b", "é"]),
        "bytes": lambda: rng.randbytes(rng.randrange(32)),
        "strlist": lambda: [rng.choice(["true", "x"]) for _ in range(rng.randrange(3))],
        "strmap": lambda: {rng.choice(["A", "B=C", ""]): rng.choice(["1", "\0"]) for _ in range(rng.randrange(3))},
    }[kind]()


def structured(rng: random.Random) -> bytes:
    """A map shaped like a request: a (mostly) safe tag and a random subset of the protocol's field names, with
    values of the right type or of any type, keys in random order."""
    msg: dict[str, object] = {}
    for name in rng.sample(sorted(FIELDS), rng.randrange(4)):
        msg[name] = _typed_value(rng, FIELDS[name]) if rng.random() < 0.6 else _rand_value(rng)
    if rng.random() < 0.9:
        msg["op"] = rng.choice(SAFE_OPS) if rng.random() < 0.9 else _rand_value(rng)
    items = list(msg.items())
    rng.shuffle(items)
    return msgspec.msgpack.encode(dict(items))


def mutated(rng: random.Random) -> bytes:
    base = bytearray(
        msgspec.msgpack.encode(
            rng.choice([P.Ping(), P.ReadFile(path="f", max_bytes=3), P.ListDir(path="."), P.Poll(pid=5)])
        )
    )
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(base))
        op = rng.randrange(3)
        if op == 0:
            base[i] = rng.randrange(256)
        elif op == 1:
            del base[i]
        else:
            base.insert(i, rng.randrange(256))
    return bytes(base)


def msgspec_accepts(body: bytes) -> bool:
    try:
        req = P.request_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return False
    return not (isinstance(req, P.Ping) and req.version != P.PROTOCOL_VERSION)


def exchange(path: str, data: bytes, *, half_close: bool = True, bound: float = ANSWER_BOUND) -> bytes:
    """Send raw bytes, then read until the agent closes (after a half-close it answers, then sees EOF)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(bound)
        s.connect(path)
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = bytearray()
        while chunk := s.recv(1 << 16):
            out += chunk
        return bytes(out)


def frames(raw: bytes) -> list[P.Response]:
    out = []
    while raw:
        assert len(raw) >= 4, f"a partial header came back: {raw!r}"
        (n,) = struct.unpack(">I", raw[:4])
        assert len(raw) >= 4 + n, "a partial frame came back"
        out.append(P.response_decoder.decode(raw[4 : 4 + n]))
        raw = raw[4 + n :]
    return out


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def check(path: str, body: bytes) -> None:
    got = frames(exchange(path, frame(body)))
    assert len(got) == 1, (body, got)
    resp = got[0]
    is_protocol_error = isinstance(resp, P.Failure) and resp.error == "protocol"
    assert is_protocol_error != msgspec_accepts(body), (body, resp)


@pytest.fixture
async def ws():  # type: ignore[no-untyped-def]
    async with Workspace() as w:
        yield w


async def test_random_frames_get_an_answer_or_a_hang_up(ws: Workspace) -> None:
    path = f"/proc/{ws.pid}/root/run/bunshin/agent.sock"
    agent_pid = await ws.ping()
    rng = random.Random(20261201)
    bodies = [structured(rng) for _ in range(600)]
    bodies += [mutated(rng) for _ in range(300)]
    bodies += [rng.randbytes(rng.randrange(64)) for _ in range(200)]
    bodies += [bytes([c]) for c in range(256)]  # every type byte alone: truncated values, ext, 0xc1
    bodies += [b"\x81\xa2op\xd4\x01\x02", b"\x81\xa2op\xc1", b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff"]
    bodies += [msgspec.msgpack.encode(P.Ping()) + b"\x00"]  # trailing bytes
    bodies += [b"\x91" * 100_000 + b"\xc0"]  # deep nesting

    start = time.monotonic()
    sem = anyio.Semaphore(8)  # several connections in flight at once

    async def one(body: bytes) -> None:
        async with sem:
            await anyio.to_thread.run_sync(check, path, body)

    async with anyio.create_task_group() as tg:
        for body in bodies:
            tg.start_soon(one, body)
    assert time.monotonic() - start < 120

    # Truncated frames: the header promises more than comes before EOF; the agent hangs up without an answer.
    for _ in range(100):
        body = structured(rng)
        cut = rng.randrange(len(body))
        assert await anyio.to_thread.run_sync(exchange, path, frame(body)[: 4 + cut]) == b""
    for partial in (b"", b"\x00", b"\x00\x00\x10"):
        assert await anyio.to_thread.run_sync(exchange, path, partial) == b""
    # Several frames in one write are answered in order.
    got = frames(
        await anyio.to_thread.run_sync(exchange, path, frame(b"\xc0") + frame(msgspec.msgpack.encode(P.Ping())) * 2)
    )
    assert [type(r) for r in got] == [P.Failure, P.Pong, P.Pong]
    # A frame over the limit is refused unread, and the connection closed.
    (resp,) = frames(await anyio.to_thread.run_sync(exchange, path, struct.pack(">I", P.MAX_REQUEST + 1)))
    assert isinstance(resp, P.Failure) and resp.error == "protocol" and "larger" in resp.message
    # Zero-length frame.
    (resp,) = frames(await anyio.to_thread.run_sync(exchange, path, frame(b"")))
    assert isinstance(resp, P.Failure) and resp.error == "protocol"

    assert await ws.ping() == agent_pid  # the same agent process, not a restarted one
    assert (await ws.exec("echo alive")).stdout == "alive\n"


@pytest.mark.slow
async def test_a_peer_silent_mid_frame_is_cut_off(ws: Workspace) -> None:
    path = f"/proc/{ws.pid}/root/run/bunshin/agent.sock"
    start = time.monotonic()
    got = await anyio.to_thread.run_sync(
        lambda: exchange(path, b"\x00\x00", half_close=False, bound=STALL_SECONDS + 20)
    )
    elapsed = time.monotonic() - start
    assert got == b"" and STALL_SECONDS - 1 < elapsed < STALL_SECONDS + 15
    assert (await ws.exec("echo alive")).stdout == "alive\n"
