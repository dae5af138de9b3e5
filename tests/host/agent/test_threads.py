"""The agent's connection threads (agent.c, "connection threads"; issue #38): a pool made at start-up, before any
workspace process, so that serving a connection takes no pid from the workspace's sequence; a connection beyond
the pool gets a thread of its own, which ends with it. What the agent has is read from the host's /proc (its
threads, their pids in the workspace's namespace); calls are held in flight by a lock a workspace process holds,
and released by killing that process from the host: counts and states, no clock."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest

from bunshin_async import Limits, Workspace
from bunshin_async._host._client import AGENT_THREADS, PIDS_PER_THREAD, agent_threads

HOLD = "exec 9>/tmp/hold; flock -x 9; sleep 1000 >/dev/null 2>&1 & echo $!"
"""Takes a lock and leaves it to a process in the background (it inherits descriptor 9), which keeps it until
killed: the call ends once the lock is held."""
WAIT = "flock -s /tmp/hold true"
"""Waits for the lock ``HOLD`` keeps, then ends."""


def _status(host_pid: int, tid: int | None = None) -> dict[str, str]:
    path = f"/proc/{host_pid}/status" if tid is None else f"/proc/{host_pid}/task/{tid}/status"
    return dict(line.split(":\t", 1) for line in Path(path).read_text().splitlines() if ":\t" in line)


def _agent(ws: Workspace) -> int:
    """The agent's host pid: pid 1's only child that pid 1 started itself."""
    pid1 = ws._core.pid
    assert pid1 is not None
    return int(Path(f"/proc/{pid1}/task/{pid1}/children").read_text().split()[0])


def _threads(ws: Workspace) -> list[int]:
    """The agent's threads, by their pids in the workspace's namespace (the last NSpid field); one that ends while
    they are listed is left out."""
    agent = _agent(ws)
    out = []
    for tid in os.listdir(f"/proc/{agent}/task"):
        try:
            out.append(int(_status(agent, int(tid))["NSpid"].split()[-1]))
        except FileNotFoundError:
            pass
    return sorted(out)


def _host_pid(ws: Workspace, pid: int) -> int:
    """The host pid of the workspace's process ``pid``."""
    assert ws.cgroup is not None
    for host_pid in ws.cgroup.pids():
        if int(_status(host_pid)["NSpid"].split()[-1]) == pid:
            return host_pid
    raise AssertionError(f"no process {pid} in the workspace")


def _running(ws: Workspace, argv: list[str]) -> int:
    """How many of the workspace's processes run ``argv``."""
    assert ws.cgroup is not None
    want = "\0".join(argv).encode() + b"\0"
    n = 0
    for host_pid in ws.cgroup.pids():
        try:
            n += Path(f"/proc/{host_pid}/cmdline").read_bytes() == want
        except OSError:
            pass
    return n


async def _next_pid(ws: Workspace) -> int:
    return int((await ws.exec("sh -c 'echo $$'")).stdout)


async def _hold(ws: Workspace, calls: int) -> list[int]:
    """Run ``calls`` calls at once and, while all of them are in flight, the agent's threads. They end normally,
    so their connections stay open and idle, each with its thread, until the next dump or ``quiesce``."""
    holder = int((await ws.exec(HOLD)).stdout)
    threads: list[int] = []
    async with anyio.create_task_group() as tg:
        for _ in range(calls):
            tg.start_soon(ws.exec, WAIT)
        with anyio.fail_after(60):  # a hang guard: the calls' commands appear in the workspace
            while _running(ws, ["flock", "-s", "/tmp/hold", "true"]) < calls:
                await anyio.sleep(0.01)
        threads = _threads(ws)
        os.kill(_host_pid(ws, holder), signal.SIGKILL)
    return threads


async def test_the_pool_is_made_before_any_workspace_process() -> None:
    async with Workspace() as ws:
        assert _threads(ws) == list(range(2, 3 + AGENT_THREADS))  # the agent, then its pool
        assert await _next_pid(ws) == 3 + AGENT_THREADS  # the first command comes after them


async def test_calls_up_to_the_pool_take_no_pid_and_one_more_takes_one() -> None:
    """Rounds of ``k`` calls at once, each started from no open connection (a dump's state): the pid sequence moves
    by what the commands take, ``step`` a call, until ``k`` passes the pool; then the connection over it gets a
    thread of its own (one pid), which ends with its connection."""
    async with Workspace() as ws:
        assert ws._core.client is not None
        pool = list(range(2, 3 + AGENT_THREADS))
        moved: dict[int, int] = {}
        for calls in (AGENT_THREADS, AGENT_THREADS - 1, AGENT_THREADS + 1):  # P - 1 after a dump with P open
            await ws._core.client.quiesce()  # as a dump does: every connection closed
            ws._core.client.resume()
            before = await _next_pid(ws)
            threads = await _hold(ws, calls)
            moved[calls] = await _next_pid(ws) - before  # over a connection the round left open: no new thread
            if calls <= AGENT_THREADS:
                assert threads == pool, calls
            else:
                (extra,) = set(threads) - set(pool)
                assert sorted(threads) == sorted([*pool, extra]) and extra > before
        step = moved[AGENT_THREADS] - moved[AGENT_THREADS - 1]  # what one more call's commands take
        assert step > 0
        assert moved[AGENT_THREADS + 1] - moved[AGENT_THREADS] == step + 1  # and one thread
        await ws._core.client.quiesce()  # the extra thread's connection closes: the thread ends
        ws._core.client.resume()
        assert await _next_pid(ws) > 0
        with anyio.fail_after(30):  # a hang guard: the extra thread has seen the hang-up
            while _threads(ws) != pool:
                await anyio.sleep(0.01)


async def test_a_burst_right_after_a_dump_finds_the_whole_pool_free() -> None:
    """A dump closes connections the pool's threads were serving, and the calls after it may come before those
    threads have seen it: the agent gives them a thread whose connection the host has closed (about to be free)
    rather than a new one. Without that, 12 bursts in 200 got a new thread here (load ~12)."""
    async with Workspace() as ws:
        assert ws._core.client is not None
        pool = list(range(2, 3 + AGENT_THREADS))
        for _ in range(50):
            async with anyio.create_task_group() as tg:
                for _ in range(AGENT_THREADS):
                    tg.start_soon(ws.ping)
            assert _threads(ws) == pool  # every connection is open (idle), each with a thread of the pool
            await ws._core.client.quiesce()
            ws._core.client.resume()


@pytest.mark.parametrize("pids", [8, 40])
async def test_a_small_pids_limit_gets_a_small_pool_and_still_serves_calls_beyond_it(pids: int) -> None:
    """One thread per ``PIDS_PER_THREAD`` of the limit, at least one, so that the workspace keeps its pids; calls
    beyond the pool still get a thread each while the limit allows."""
    size = agent_threads(pids)
    assert size == max(1, pids // PIDS_PER_THREAD) < AGENT_THREADS
    async with Workspace(limits=Limits(pids=pids)) as ws:
        assert _threads(ws) == list(range(2, 3 + size))
        await _hold(ws, size + 1)
        assert (await ws.exec("sh -c 'true & wait'; echo ok")).stdout == "ok\n"


@pytest.mark.unit
def test_the_pool_follows_the_pids_limit() -> None:
    assert agent_threads(None) == agent_threads(4096) == AGENT_THREADS
    assert agent_threads(8) == agent_threads(PIDS_PER_THREAD * 2 - 1) == 1
    assert agent_threads(PIDS_PER_THREAD * 3) == 3
    assert agent_threads(PIDS_PER_THREAD * AGENT_THREADS) == agent_threads(1 << 22) == AGENT_THREADS
