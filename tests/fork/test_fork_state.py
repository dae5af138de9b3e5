"""Forks carry the whole live state of a workspace: heap, shell session, open files, pipes, sockets, TCP, jobs."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from bunshin_async import Shell, Workspace

HEAP_MIB = 50


async def _wait_file(ws: Workspace, path: str, timeout: float = 30.0) -> str:
    with anyio.fail_after(timeout):
        while True:
            r = await ws.exec(f"cat {path} 2>/dev/null")
            if r.exit_code == 0 and r.stdout:
                return r.stdout
            await anyio.sleep(0.05)


async def _http_digest(ws: Workspace) -> str:
    code = "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8080/').read().decode())"
    r = await ws.exec(["python3", "-c", code], timeout=30)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


async def _advances(ws: Workspace, name: str) -> None:
    first = int(await _wait_file(ws, f"/workspace/{name}"))
    with anyio.fail_after(10):
        while int(await _wait_file(ws, f"/workspace/{name}")) <= first:
            await anyio.sleep(0.05)


def _adopt_shell(sh: Shell, ws: Workspace) -> Shell:
    """The shell session lives in the agent, which the fork copied: address it through the copy."""
    twin = Shell(ws, cwd=None, env={})
    twin._id = sh._id
    return twin


async def _start_state(ws: Workspace) -> tuple[str, Shell]:
    await ws.write_file("/workspace/data.bin", bytes(range(256)) * 64)
    await ws.spawn(["python3", "/workspace/guest_state.py", "server", str(HEAP_MIB)], log_path="/workspace/srv.log")
    for mode in ("reader", "pipe", "sockpair", "tcpclient"):
        await ws.spawn(["python3", "/workspace/guest_state.py", mode], log_path=f"/workspace/{mode}.log")
    await ws.spawn("i=0; while true; do i=$((i+1)); echo $i > /workspace/tick; sleep 0.02; done")
    digest = (await _wait_file(ws, "/workspace/digest", 120)).strip()
    await _wait_file(ws, "/workspace/reader.ready")
    for name in ("pipe.last", "sp.count", "tcp.count", "tick"):
        await _wait_file(ws, f"/workspace/{name}")
    sh = ws.shell()
    await sh.open()
    r = await sh.run("mkdir -p /tmp/deep/dir && cd /tmp/deep/dir && SECRET=forty-two && export EXP=yes")
    assert r.exit_code == 0
    return digest, sh


async def _check_state(ws: Workspace, digest: str, sh: Shell) -> None:
    assert await _http_digest(ws) == digest
    r = await sh.run('echo "$SECRET $EXP $(pwd)"')
    assert r.stdout == "forty-two yes /tmp/deep/dir\n"
    for name in ("pipe.last", "sp.count", "tcp.count", "tick"):
        await _advances(ws, name)
    await ws.write_file("/workspace/go", "1")
    out = await _wait_file(ws, "/workspace/reader.out")
    assert out == f"1010 {(bytes(range(256)) * 64)[1000:1010].hex()}"
    errors = await ws.exec("cat /workspace/*.error 2>/dev/null")
    assert errors.stdout == ""


@pytest.mark.slow
async def test_fork_carries_live_state(ws: Workspace, fork_mode: str) -> None:
    digest, sh = await _start_state(ws)
    copies = await ws.fork(2)
    try:
        assert [c.fork_mode for c in copies] == [fork_mode, fork_mode]
        assert ws.fork_mode == "fresh"
        assert len({c.id for c in copies} | {ws.id}) == 3
        for c in copies:
            await _check_state(c, digest, _adopt_shell(sh, c))
        await _check_state(ws, digest, sh)  # the parent kept running, untouched
    finally:
        for c in copies:
            await c.aclose()


async def test_copies_are_isolated(ws: Workspace) -> None:
    await ws.write_file("/workspace/shared", "before")
    a, b = await ws.fork(2)
    try:
        await a.write_file("/workspace/shared", "a")
        await a.write_file("/workspace/only-a", "a")
        await a.exec("rm /etc/hostname")
        await ws.write_file("/workspace/only-parent", "p")
        assert await b.read_text("/workspace/shared") == "before"
        assert await ws.read_text("/workspace/shared") == "before"
        for other in (b, ws):
            assert (await other.exec("ls /workspace/only-a")).exit_code != 0
            assert (await other.exec("cat /etc/hostname")).stdout == "bunshin\n"
        assert (await a.exec("ls /workspace/only-parent")).exit_code != 0
        # Separate pid, net and mount namespaces: the same in-workspace pid, but different host pids.
        assert a.pid != b.pid != ws.pid
        assert await a.ping() == await b.ping() == await ws.ping()
        assert a.cgroup is not None and a.cgroup.pids() and set(a.cgroup.pids()).isdisjoint(ws.cgroup.pids())  # type: ignore[union-attr]
    finally:
        await a.aclose()
        await b.aclose()


_SHM_GUEST = """
import mmap, os, time
fd = os.open("/dev/shm/seg", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)  # MAP_SHARED: the file is the memory
m[:5] = b"hello"
open("/workspace/shm.ready", "w").write("1")
while True:
    try:
        data = open("/workspace/shm.poke", "rb").read()
    except FileNotFoundError:
        time.sleep(0.01)
        continue
    os.remove("/workspace/shm.poke")
    m[:5] = data[:5]
    open("/workspace/shm.seen", "w").write(open("/dev/shm/seg", "rb").read(5).decode())
"""


async def test_shared_memory_segment_forks(ws: Workspace) -> None:
    """A POSIX shared memory segment (/dev/shm, a directory of the overlay) mapped by a live process: each copy's
    process maps its own copy of the file, and writes through the mapping reach no sibling or parent."""
    await ws.write_file("/workspace/shm.py", _SHM_GUEST)
    await ws.spawn(["python3", "/workspace/shm.py"], log_path="/workspace/shm.log")
    await _wait_file(ws, "/workspace/shm.ready")
    a, b = await ws.fork(2)
    try:
        for c in (a, b, ws):
            assert (await c.exec("head -c 5 /dev/shm/seg")).stdout == "hello"
        await a.write_file("/workspace/shm.poke", "world")
        assert await _wait_file(a, "/workspace/shm.seen") == "world"
        for c in (b, ws):
            assert (await c.exec("head -c 5 /dev/shm/seg")).stdout == "hello"
        await b.write_file("/workspace/shm.poke", "bbbbb")
        assert await _wait_file(b, "/workspace/shm.seen") == "bbbbb"
        assert (await a.exec("head -c 5 /dev/shm/seg")).stdout == "world"
        assert (await ws.exec("cat /workspace/shm.log")).stdout == ""
    finally:
        await a.aclose()
        await b.aclose()


async def test_fork_of_fork_three_generations(ws: Workspace) -> None:
    await ws.exec("echo 0 > /workspace/gen")
    sh = ws.shell()
    await sh.open()
    await sh.run("COUNT=0")
    current, made = ws, []
    try:
        for gen in range(1, 4):
            (child,) = await current.fork()
            made.append(child)
            csh = _adopt_shell(sh, child)
            assert (await csh.run("echo $COUNT")).stdout == f"{gen - 1}\n"
            await csh.run(f"COUNT={gen}")
            assert (await child.read_text("/workspace/gen")).strip() == str(gen - 1)
            await child.exec(f"echo {gen} > /workspace/gen")
            current = child
        assert (await ws.read_text("/workspace/gen")).strip() == "0"
        assert (await sh.run("echo $COUNT")).stdout == "0\n"
    finally:
        for c in made:
            await c.aclose()


async def test_snapshot_outlives_parent_and_restores_many() -> None:
    async with Workspace() as ws:
        await ws.exec("echo snap > /workspace/f")
        snap = await ws.snapshot()
    async with snap:
        copies = await Workspace.from_snapshot(snap, 3)
        try:
            for c in copies:
                assert await c.read_text("/workspace/f") == "snap\n"
        finally:
            for c in copies:
                await c.aclose()


@pytest.mark.slow
async def test_fan_out_16(ws: Workspace) -> None:
    await ws.exec("echo fan > /workspace/f")
    copies = await ws.fork(16)
    try:
        assert len({c.pid for c in copies}) == 16
        for i, c in enumerate(copies):
            await c.write_file("/workspace/i", str(i))
        for i, c in enumerate(copies):
            assert await c.read_text("/workspace/i") == str(i)
            assert await c.read_text("/workspace/f") == "fan\n"
    finally:
        for c in copies:
            await c.aclose()


def _kill_sleep(ws: Workspace) -> bool:
    """Kill the workspace's ``sleep`` from the host (its cgroup's pids): what lets the held command go on."""
    assert ws.cgroup is not None
    for pid in ws.cgroup.pids():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "sleep":
                    os.kill(pid, signal.SIGKILL)
                    return True
        except (OSError, ProcessLookupError):
            pass
    return False


async def test_fork_waits_for_running_command(ws: Workspace) -> None:
    """Policy: a fork waits for tool calls in flight (a host connection cannot be dumped); the command finishes
    in the parent only, and the copy sees its effects. The command is held (``sleep 1000``) until the fork waits
    for it (its client's drain waits for the call in flight); the host then lets it go on. So the order is the
    policy's whatever a fork takes: the command's result before the fork's copies, the copy with the command's
    effect and without its process (a copy made mid-command would have the sleep and no /workspace/cmd)."""
    order: list[str] = []
    results = {}
    client = ws._core.client
    assert client is not None
    idle = client._drained  # the drain waits on a fresh event while a call is in flight (AgentClient.quiesce)

    async def long_command() -> None:
        results["exec"] = await ws.exec("touch /workspace/started; sleep 1000; echo done > /workspace/cmd; echo ok")
        order.append("command returned")

    async def fork() -> None:
        (results["child"],) = await ws.fork()
        order.append("fork returned")

    async def let_go_once_the_fork_waits() -> None:
        while client._drained is idle or client._drained.is_set():
            if order:  # the fork returned without waiting: leave the command held (the copy shows it)
                return
            await anyio.sleep(0.005)
        order.append("fork waits")
        assert await anyio.to_thread.run_sync(_kill_sleep, ws)

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(long_command)
                while (await ws.exec("test -e /workspace/started")).exit_code:  # noqa: ASYNC110 - polls the guest
                    await anyio.sleep(0.02)
                tg.start_soon(let_go_once_the_fork_waits)
                await fork()
                if "command returned" not in order:  # a fork that did not wait: let the command end, then fail
                    await anyio.to_thread.run_sync(_kill_sleep, ws)
        in_parent = (await ws.exec("cat /workspace/cmd 2>/dev/null || echo running")).stdout
        assert order == ["fork waits", "command returned", "fork returned"]
        assert results["exec"].stdout == "ok\n" and in_parent == "done\n"
        child = results["child"]
        assert await child.read_text("/workspace/cmd") == "done\n"
        assert "sleep" not in (await child.exec("ps -eo comm")).stdout
    finally:
        if "child" in results:
            await results["child"].aclose()
