"""A hostile workspace against its agent: killing it, flooding its socket, answering in its place, drowning it in
output. The host always gets a clear ``WorkspaceClosed``/``AgentError`` (or a correct answer) within a bound, never
a hang."""

from __future__ import annotations

from collections.abc import Awaitable

import anyio
import pytest

from bunshin_async import AgentError, InvalidArgument, Limits, ToolError, ToolTimeout, Workspace, WorkspaceClosed

FLOOD = """
import socket, sys, time
n = int(sys.argv[1])
held = []
for i in range(n):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect("/run/bunshin/agent.sock")
    except OSError:
        continue
    s.send([b"", b"\\x00\\x00", b"\\x00\\x00\\x00\\x05\\x81", b"\\xff\\xff\\xff\\xff"][i % 4])
    held.append(s)
open("/workspace/flood.ready", "w").write(str(len(held)))
time.sleep(1000)
"""

FAKE_AGENT = """
import os, socket, struct, sys
mode = sys.argv[1]
os.unlink("/run/bunshin/agent.sock")
srv = socket.socket(socket.AF_UNIX)
srv.bind("/run/bunshin/agent.sock")
srv.listen(16)
open("/workspace/fake.ready", "w").write("1")
while True:
    c, _ = srv.accept()
    n = struct.unpack(">I", c.recv(4))[0]
    c.recv(n)
    if mode == "garbage":
        c.sendall(struct.pack(">I", 3) + b"\\xc1\\xc1\\xc1")
    elif mode == "huge":
        c.sendall(struct.pack(">I", 0xFFFFFFFF) + b"x" * 100)
    c.close()
"""


async def _wait_file(ws: Workspace, path: str) -> str:
    with anyio.fail_after(20):
        while True:
            r = await ws.exec(["cat", path])
            if r.ok:
                return r.stdout
            await anyio.sleep(0.05)


async def test_killing_the_agent_ends_the_workspace_with_a_clear_error() -> None:
    async with Workspace() as ws:
        agent = await ws.ping()
        with pytest.raises(WorkspaceClosed) as info, anyio.fail_after(60):  # the call ends, not its `sleep 100`
            await ws.exec(f"kill -9 {agent}; sleep 100")
        assert "went away during Exec" in str(info.value) and info.value.workspace_id == ws.id
        with pytest.raises(WorkspaceClosed):
            with anyio.fail_after(10):
                while True:
                    await ws.exec("true")
                    await anyio.sleep(0.01)


async def test_a_background_process_killing_the_agent_fails_a_call_in_flight() -> None:
    async with Workspace() as ws:
        agent = await ws.ping()
        await ws.spawn(f"sleep 0.5; kill -9 {agent}")
        with anyio.fail_after(15), pytest.raises(WorkspaceClosed):
            await ws.exec("sleep 100")


async def test_a_connection_flood_does_not_stop_the_host() -> None:
    async with Workspace() as ws:
        await ws.write_file("flood.py", FLOOD)
        flood = await ws.spawn(["python3", "flood.py", "400"])
        assert int(await _wait_file(ws, "flood.ready")) == 400
        with anyio.fail_after(20):
            assert (await ws.exec("echo still")).stdout == "still\n"
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(ws.exec, "true")
        await flood.kill()
        assert (await ws.exec("echo after")).stdout == "after\n"


async def test_a_flood_past_the_pids_limit_gives_answers_or_workspace_closed() -> None:
    async with Workspace(limits=Limits(pids=64)) as ws:
        await ws.write_file("flood.py", FLOOD)
        await ws.spawn(["python3", "flood.py", "300"])
        assert ws.cgroup is not None
        events = next(d / "pids.events" for d in ws.cgroup.dirs if (d / "pids.events").exists())
        with anyio.fail_after(60):  # until the kernel has refused the workspace a task (a hang guard)
            while dict(line.split() for line in events.read_text().splitlines())["max"] == "0":
                await anyio.sleep(0.05)
        outcomes = []
        with anyio.fail_after(30):
            for _ in range(5):
                try:
                    outcomes.append((await ws.exec(["true"])).exit_code)
                except (WorkspaceClosed, ToolError, ToolTimeout) as exc:
                    outcomes.append(type(exc).__name__)
        # No thread for our connection: a hang-up; no pid for the command: "cannot run 'true': Resource
        # temporarily unavailable". Either is a clear error, in time.
        assert all(o in (0, "WorkspaceClosed", "ToolError") for o in outcomes), outcomes


@pytest.mark.parametrize(("mode", "error"), [("garbage", AgentError), ("huge", AgentError), ("close", WorkspaceClosed)])
async def test_an_impostor_on_the_agent_socket(mode: str, error: type[Exception]) -> None:
    async with Workspace() as ws:
        await ws.write_file("fake.py", FAKE_AGENT)
        await ws.spawn(["python3", "fake.py", mode])
        await _wait_file(ws, "fake.ready")
        assert ws._core.client is not None
        for conn in ws._core.client._idle:  # pooled connections still reach the real agent; new ones the impostor
            await conn.aclose()
        ws._core.client._idle.clear()
        with anyio.fail_after(10), pytest.raises(error):
            await ws.exec("true")


async def test_huge_output_is_capped_in_exec_and_shell_with_bounded_agent_memory() -> None:
    async with Workspace(max_output=1 << 20) as ws:
        agent = await ws.ping()
        r = await ws.exec("head -c 300000000 /dev/zero | tr '\\0' b; echo end >&2", timeout=120)
        assert r.truncated and len(r.stdout) == 1 << 20 and r.stderr == "end\n"
        async with ws.shell() as sh:
            r = await sh.run("head -c 300000000 /dev/zero | tr '\\0' c; echo end >&2", timeout=120)
            assert r.truncated and len(r.stdout) == 1 << 20 and set(r.stdout) == {"c"} and r.stderr == "end\n"
            assert (await sh.run("echo ok")).stdout == "ok\n"
        r = await ws.exec("head -c 50000000 /dev/urandom", timeout=60)  # not UTF-8: replaced, still capped
        assert r.truncated and "\ufffd" in r.stdout
        status = (await ws.exec(["cat", f"/proc/{agent}/status"])).stdout
        hwm_kib = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1])
        assert hwm_kib < 32 * 1024, status  # a few output buffers, never the flood


async def test_concurrent_requests_run_in_parallel_and_cancel_alone() -> None:
    async with Workspace() as ws:
        # Each of 8 commands checks in, then waits (up to 60 s) until all 8 have: run one after the other, the first
        # would wait in vain and fail.
        await ws.exec("mkdir /tmp/in")
        wait = "touch /tmp/in/{0}; for i in $(seq 600); do [ $(ls /tmp/in | wc -l) = 8 ] && exit 0; sleep 0.1; done"
        wait += "; exit 1"
        results: list[int] = []

        async def one(i: int) -> None:
            results.append((await ws.exec(wait.format(i), timeout=90)).exit_code)

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        assert results == [0] * 8
        async with ws.shell() as sh:
            await sh.run("X=kept")
            with anyio.move_on_after(0.5):
                await sh.run("sleep 1000")  # cancelled: the host hangs up, the agent ends the command
            with anyio.fail_after(10):
                while "sleep" in (await ws.exec("ps -eo comm")).stdout:
                    await anyio.sleep(0.05)
            assert (await sh.run("echo $X")).stdout == "kept\n"


SPECIAL = """
import os, socket
os.mkfifo("/workspace/fifo")
socket.socket(socket.AF_UNIX).bind("/workspace/sock")
os.symlink("fifo", "/workspace/to-fifo")
"""


async def _refused(call: Awaitable[object], kind: str) -> None:
    """A file tool meeting a file that is not regular fails at once (a fifo would block the agent for good)."""
    with anyio.fail_after(30), pytest.raises(InvalidArgument, match=f"{kind}, not a regular file"):
        await call


@pytest.mark.parametrize("where", ["workspace", "fork"])
async def test_file_tools_refuse_fifos_sockets_and_devices(where: str) -> None:
    """read_file, write_file (and append) and a spawn's log at a fifo, a symlink to one, a socket, and (with the
    workspace directory at /dev) /dev/zero, /dev/null and /dev/tty: each an ``InvalidArgument`` without opening the
    file, and the workspace goes on."""
    async with Workspace() as parent:
        ws = parent if where == "workspace" else (await parent.fork())[0]
        try:
            assert (await ws.exec(["python3", "-c", SPECIAL])).exit_code == 0
            for path, kind in (("fifo", "a fifo"), ("to-fifo", "a fifo"), ("sock", "a socket")):
                await _refused(ws.read_file(path), kind)
                await _refused(ws.read_file(path, max_bytes=10), kind)
                await _refused(ws.write_file(path, "x"), kind)
                await _refused(ws.write_file(path, "x", append=True), kind)
                await _refused(ws.spawn(["true"], log_path=path), kind)
            await ws.write_file("after", "ok")
            assert await ws.read_file("after") == b"ok"
            assert (await ws.exec("echo alive")).stdout == "alive\n"
        finally:
            if ws is not parent:
                await ws.aclose()
    async with Workspace(workdir="/dev") as ws:
        for path in ("zero", "null", "urandom", "tty"):
            await _refused(ws.read_file(path, max_bytes=16), "a character device")
            await _refused(ws.write_file(path, "x"), "a character device")
        await _refused(ws.read_file("pts"), "a directory")
        assert (await ws.exec("echo alive")).stdout == "alive\n"
