"""The host's channel to a workspace's agent, attacked from inside (issue 31, cases 1, 4 and 5), in a workspace and
in a live fork of one (``box``): a replaced or redirected agent socket is never followed to a host socket, an
impostor on the socket gets bounded, clear ``AgentError``s, and a path too long for the kernel is refused rather
than cut to name another file. Each attempt leaves the host unchanged (``host``), nothing behind (``no_leaks``) and
the workspace usable."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from bunshin_async import AgentError, PathTooLong, Workspace
from bunshin_async._compat import BaseExceptionGroup
from bunshin_async._host._client import AgentClient

from .conftest import Box

pytestmark = pytest.mark.usefixtures("host")


class Listener:
    """A Unix socket listening on the host, which no workspace may make the host connect to. Connections queue in
    its backlog without an ``accept``, so ``contacted`` sees every one that was made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(64)
        self.sock.setblocking(False)

    def contacted(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    d = Path(tempfile.mkdtemp(prefix="i31-host-"))
    lst = Listener(d / "agent.sock")
    try:
        yield lst
        assert lst.contacted() == 0, "the host connected to a host socket the workspace named"
    finally:
        lst.close()
        shutil.rmtree(d)


def _client(ws: Workspace) -> AgentClient:
    client = ws._core.client
    assert client is not None
    return client


@asynccontextmanager
async def fresh_connections(ws: Workspace) -> AsyncIterator[None]:
    """Inside, every call opens a new connection (what a new call in flight does): the pooled ones, which still
    reach the real agent, are set aside and put back afterwards; those made inside are closed."""
    client = _client(ws)
    held, client._idle = client._idle, []
    try:
        yield
    finally:
        made, client._idle = client._idle, held
        for conn in made:
            await conn.aclose()


async def _still_usable(ws: Workspace) -> None:
    async with fresh_connections(ws):
        assert (await ws.exec("echo alive")).stdout == "alive\n"
        assert await ws.read_file("/run/bunshin/../../workspace/attempts.py")


# ------------------------------------------------------------------------------------------------ case 1


async def _own_answer_or_refused(ws: Workspace) -> None:
    """A copy restored with its socket replaced: CRIU binds the agent's listening socket at its name again (then
    the copy answers as itself) or the host refuses the replaced one; it never reaches the host's listener."""
    try:
        with anyio.fail_after(20):
            assert await ws.read_file("/workspace/who") == b"parent"
    except AgentError as exc:
        assert exc.reason == "socket"


REPLACEMENTS = {
    # the attack: the socket becomes an absolute symlink to a socket on the host
    "symlink-to-host": "mv agent.sock real.sock && ln -s {host} agent.sock",
    # the socket's directory becomes a symlink to the host's directory holding a listener (the socket is moved
    # aside, not its directory: overlayfs renames a lower-layer directory by copying it, a socket as a new inode)
    "dir-symlink-to-host": "mkdir /run/aside && mv agent.sock /run/aside && cd / && rm -r /run/bunshin "
    "&& ln -s {host_dir} /run/bunshin",
    # a relative symlink climbing out of the root ("../" stays at the root under RESOLVE_IN_ROOT)
    "relative-symlink-to-host": "mv agent.sock real.sock && ln -s ../../../../../../../..{host} agent.sock",
    # a procfs magic link (to the workspace's own root: harmless, still not followed)
    "magic-link": "mv agent.sock real.sock && ln -s /proc/1/root/run/bunshin/real.sock agent.sock",
    "fifo": "mv agent.sock real.sock && mkfifo agent.sock",
    "regular-file": "mv agent.sock real.sock && echo x > agent.sock",
    "directory": "mv agent.sock real.sock && mkdir agent.sock",
    "removed": "mv agent.sock real.sock",
}
UNDO = {
    "dir-symlink-to-host": "cd /run && rm bunshin && mkdir bunshin && mv aside/agent.sock bunshin/",
}


@pytest.mark.parametrize("name", list(REPLACEMENTS))
async def test_a_replaced_agent_socket_is_not_followed(box: Box, listener: Listener, name: str) -> None:
    ws = box.ws
    plant = REPLACEMENTS[name].format(host=listener.path, host_dir=listener.path.parent)
    r = await ws.exec(f"cd /run/bunshin && {plant}")
    assert r.exit_code == 0, r.stderr
    async with fresh_connections(ws):
        for _ in range(3):
            with anyio.fail_after(20), pytest.raises(AgentError) as info:
                await ws.exec("echo reached")
            assert info.value.reason == "socket" and info.value.workspace_id == ws.id
        with anyio.fail_after(20), pytest.raises(BaseExceptionGroup) as group:  # concurrent, as in the issue
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(ws.exec, "echo reached")
        assert all(isinstance(e, AgentError) for e in group.value.exceptions)
    assert listener.contacted() == 0
    undo = UNDO.get(name, "cd /run/bunshin && rm -rf agent.sock && mv real.sock agent.sock")
    assert (await ws.exec(undo)).exit_code == 0
    await _still_usable(ws)


async def test_another_workspaces_agent_is_not_reachable(box: Box) -> None:
    """The socket becomes a symlink to another workspace's agent at its host path: the host must not take that
    workspace's answers as this one's."""
    async with Workspace() as other:
        await other.write_file("/workspace/marker", "other")
        target = f"/proc/{other._core.pid}/root/run/bunshin/agent.sock"
        await box.ws.exec(f"cd /run/bunshin && mv agent.sock real.sock && ln -s {target} agent.sock")
        async with fresh_connections(box.ws):
            with anyio.fail_after(20), pytest.raises(AgentError):
                await box.ws.read_file("/workspace/marker")
        await box.ws.exec("cd /run/bunshin && rm agent.sock && mv real.sock agent.sock")
        await _still_usable(box.ws)
        assert await other.read_file("/workspace/marker") == b"other"


async def test_every_copy_rollback_and_spare_has_its_own_channel(box: Box, listener: Listener) -> None:
    """Copies restored from one snapshot, warm spares and a rollback each reach their own agent; a snapshot taken
    with the socket replaced gives copies whose socket is replaced too, and they still reach no host socket."""
    ws = box.ws
    await ws.write_file("/workspace/who", "parent")
    async with await ws.snapshot() as snap:
        async with snap.keep_spares(2) as pool:
            await pool.wait_ready()
            copies = await Workspace.from_snapshot(snap, 3)  # two thawed spares and one restored
            try:
                for i, c in enumerate(copies):
                    await c.write_file("/workspace/who", f"copy{i}")
                for i, c in enumerate(copies):
                    assert await c.read_file("/workspace/who") == f"copy{i}".encode()
            finally:
                for c in copies:
                    await c.aclose()
        await ws.exec(f"cd /run/bunshin && mv agent.sock real.sock && ln -s {listener.path} agent.sock")
        async with await ws.snapshot() as bad:
            (copy,) = await Workspace.from_snapshot(bad)  # restored: it has no pooled connection
            try:
                await _own_answer_or_refused(copy)
            finally:
                await copy.aclose()
            async with fresh_connections(ws):
                with anyio.fail_after(20), pytest.raises(AgentError):
                    await ws.exec("echo reached")
            await ws.rollback(snap)  # the socket as it was at the first snapshot
            assert await ws.read_file("/workspace/who") == b"parent"
            await ws.rollback(bad)
            await _own_answer_or_refused(ws)
            await ws.rollback(snap)
            await _still_usable(ws)


# ------------------------------------------------------------------------------------------------ case 5

IMPOSTOR = r"""
import os, socket, struct, sys, time
mode = sys.argv[1]
os.chdir("/run/bunshin")
srv = socket.socket(socket.AF_UNIX)
srv.bind("fake.sock")
srv.listen(4)
os.rename("agent.sock", "real.sock")
os.rename("fake.sock", "agent.sock")
open("/workspace/impostor.ready", "w").write("1")
c, _ = srv.accept()
os.rename("real.sock", "agent.sock")  # the next connection reaches the real agent again
n = struct.unpack(">I", c.recv(4))[0]
while n:
    n -= len(c.recv(n))

def frame(body):
    return struct.pack(">I", len(body)) + body

def pack_map(d):  # msgpack of a flat map of str -> (str | int | bool | bytes)
    out = bytes([0x80 | len(d)])
    for k, v in d.items():
        for x in (k, v):
            if isinstance(x, bool):
                out += b"\xc3" if x else b"\xc2"
            elif isinstance(x, int):
                out += b"\xcf" + struct.pack(">Q", x)
            elif isinstance(x, bytes):
                out += b"\xc6" + struct.pack(">I", len(x)) + x
            else:
                b = x.encode()
                out += b"\xdb" + struct.pack(">I", len(b)) + b
    return out

ok = frame(pack_map({"kind": "exec_result", "exit_code": 0, "stdout": "impostor\n", "stderr": "", "duration": 0}))
if mode == "oversized":
    c.sendall(struct.pack(">I", 0xFFFFFFF0) + b"x" * 4096)
elif mode == "truncated":
    c.sendall(struct.pack(">I", 1000) + b"\x85" + b"x" * 10)
elif mode == "stalled":
    c.sendall(struct.pack(">I", 1000) + b"\x85" + b"x" * 10)
    time.sleep(3600)
elif mode == "trickle":  # never pauses for the stall timeout, never ends either
    c.sendall(struct.pack(">I", 1 << 20))
    for _ in range(36000):
        c.sendall(b"x")
        time.sleep(0.1)
elif mode == "stalled-header":
    c.sendall(b"\x00\x00")
    time.sleep(3600)
elif mode == "garbage":
    c.sendall(frame(b"\xc1\xc1\xc1\xc1"))
elif mode == "wrong-kind":
    c.sendall(frame(pack_map({"kind": "pong", "version": 2, "pid": 1})))
elif mode == "over-max-output":
    c.sendall(frame(pack_map({"kind": "exec_result", "exit_code": 0, "stdout": "y" * (7 << 20), "stderr": "",
                              "duration": 0})))
elif mode == "over-max-bytes":
    c.sendall(frame(pack_map({"kind": "file_data", "data": b"z" * (1 << 20)})))
elif mode == "slow-but-valid":
    time.sleep(1.5)  # a long command: no answer begun yet, so no stall
    c.sendall(ok)
c.close()
"""


async def _impostor(ws: Workspace, mode: str) -> None:
    await ws.write_file("/workspace/impostor.py", IMPOSTOR)
    await ws.spawn(["python3", "/workspace/impostor.py", mode])
    with anyio.fail_after(30):
        while not (await ws.exec(["test", "-e", "/workspace/impostor.ready"])).ok:
            await anyio.sleep(0.05)


FRAMES = {
    "oversized": "oversized",
    "over-max-output": "oversized",
    "over-max-bytes": "oversized",
    "truncated": "truncated",
    "stalled": "stalled",
    "stalled-header": "stalled",
    "trickle": "stalled",
    "garbage": "protocol",
    "wrong-kind": "protocol",
}


@pytest.mark.parametrize("mode", list(FRAMES))
async def test_an_impostors_bad_frames_are_bounded_agent_errors(box: Box, mode: str) -> None:
    ws = box.ws
    await _impostor(ws, mode)
    _client(ws).stall_timeout = 0.5
    async with fresh_connections(ws):
        with anyio.fail_after(30), pytest.raises(AgentError) as info:
            if mode == "over-max-bytes":
                await ws.read_file("/workspace/attempts.py", max_bytes=100)
            else:
                await ws.exec("echo hello")  # max_output 1 MiB: an answer of at most 6 MiB and the envelope
    assert info.value.reason == FRAMES[mode], info.value
    assert info.value.workspace_id == ws.id and info.value.request in ("Exec", "ReadFile")
    await _still_usable(ws)


async def test_a_slow_answer_is_no_stall(box: Box) -> None:
    """The stall timeout starts with an answer's first byte: a command may run long before it answers."""
    ws = box.ws
    await _impostor(ws, "slow-but-valid")
    _client(ws).stall_timeout = 0.5
    async with fresh_connections(ws):
        assert (await ws.exec("echo hello")).stdout == "impostor\n"
    await _still_usable(ws)


async def test_an_oversized_frame_allocates_nothing(box: Box) -> None:
    """A 4 GiB announcement is refused on its header: the host reads nothing more of it."""
    ws = box.ws
    await _impostor(ws, "oversized")
    import tracemalloc

    tracemalloc.start()
    try:
        async with fresh_connections(ws):
            with pytest.raises(AgentError):
                await ws.exec("true")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    await _still_usable(ws)


# ------------------------------------------------------------------------------------------------ case 4

LONG = "keep/" + "/".join(["b" * 200] * 25)  # the path: 5,029 characters


LONG_PATH_CALLS: dict[str, Callable[[Workspace], Awaitable[object]]] = {
    "write_file": lambda ws: ws.write_file(LONG, "x"),
    "read_file": lambda ws: ws.read_file(LONG),
    "list_dir": lambda ws: ws.list_dir(LONG),
    "remove": lambda ws: ws.remove(LONG, recursive=True),
    "spawn": lambda ws: ws.spawn(["true"], log_path=LONG),
    "exec": lambda ws: ws.exec(["true"], cwd="/workspace/" + LONG),
}


@pytest.mark.parametrize("tool", list(LONG_PATH_CALLS))
async def test_a_path_longer_than_path_max_is_refused_on_every_file_tool(box: Box, tool: str) -> None:
    ws = box.ws
    with pytest.raises(PathTooLong) as info:
        await LONG_PATH_CALLS[tool](ws)
    assert info.value.tool == tool and info.value.length >= len(LONG) - len("/workspace/")
    assert info.value.limit == 4096
    # nothing was written anywhere, under the long name or a shorter one it could have been cut to
    assert (await ws.exec("ls -A /workspace")).stdout.split() == ["attempts.py"]
    await _still_usable(ws)


async def test_a_long_path_within_the_limit_works(box: Box) -> None:
    ws = box.ws
    path = "/".join(["c" * 200] * 18)  # 3,617 characters, + /workspace/: under PATH_MAX
    await ws.write_file(path, "deep")
    assert await ws.read_file(path) == b"deep"
    assert [e.name for e in await ws.list_dir(path.rsplit("/", 1)[0])] == ["c" * 200]
    await ws.remove("c" * 200, recursive=True)


async def test_a_symlink_making_a_path_too_long_is_refused(box: Box) -> None:
    """The path is short, but following a symlink in it makes it longer than PATH_MAX."""
    ws = box.ws
    deep = "/workspace/" + "/".join(["d" * 250] * 15)
    await ws.exec(["mkdir", "-p", deep])
    await ws.exec(["ln", "-s", deep, "/workspace/link"])
    with pytest.raises(PathTooLong):
        await ws.write_file("link/" + "/".join(["e" * 250] * 2), "x")
    assert (await ws.exec(f"ls -A {deep}")).stdout == ""
    await ws.exec(["rm", "-rf", "/workspace/link", "/workspace/" + "d" * 250])
