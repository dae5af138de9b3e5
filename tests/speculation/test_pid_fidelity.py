"""Issue #38 through the runtime: a rollout that committed a speculative fork prints the pids the plain loop prints
(`cmd & echo $!`). The fork's dump closed the main line's connection to the agent and the copy's first call opened
one; an agent that made a thread per connection took a pid for it there, and the experiment's oracle runs printed
another `PID: $!` than fork+cache (docs/concepts/workspace.md, the agent's threads)."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest

from bunshin_async import Workspace
from bunshin_async._host._pidcursor import ReadPids, exchange_last_pid
from bunshin_async._workspace._facade import in_place
from bunshin_async.speculation import BoundedPolicy, Speculation
from bunshin_async.tools import builtin_tools
from speculator import Rule, RulePredictor

from .agent_loop import agent_rollout, held_client
from .conftest import bash, final, trajectory

BACKGROUND = "sleep 100 >/dev/null 2>&1 & echo $!"


async def test_a_committed_fork_prints_the_pids_the_plain_loop_prints(serve: Any) -> None:
    traj = trajectory("pids", [bash("echo 0 > g", turn=0), bash("echo a > f", turn=1), bash(BACKGROUND, turn=2),
                               bash(BACKGROUND, turn=3), final()])  # fmt: skip
    # the write after the first call, predicted right: it runs in a fork (after a connection was open), committed
    rule = Rule(after="echo 0", then_tool="bash", then_args={"command": "echo a > f"}, probability=1.0,
                expected_seconds=1.0)  # fmt: skip
    spec = Speculation(predictors=[RulePredictor([rule])], policy=BoundedPolicy(), group=traj.task_id, early=True)
    tools = builtin_tools()
    async with serve([traj]) as client:
        async with Workspace() as ws:
            on = await agent_rollout(client, f"replay:{traj.key}", ws, tools, spec, task_id=traj.task_id)
        async with Workspace() as ws:
            off = await agent_rollout(client, f"replay:{traj.key}", ws, tools, None)
    assert on.metrics.committed == 1
    assert on.calls == off.calls


READ = "cat g; ls -d /tmp"  # a read (run in place) that starts processes


async def test_an_unused_read_run_in_place_leaves_the_plain_loops_pids(serve: Any) -> None:
    # A read predicted after the first call runs in place while the model thinks; the model asks for a write
    # instead. The read's processes took pids in the rollout's own workspace: unless they are handed out again, the
    # next `sleep & echo $!` prints another pid than the plain loop (12 vs 11 before). The model's answer is held
    # until the read's call returned (``held_client``): under load it could come first, and the read would be cut.
    traj = trajectory("pids", [bash("echo 0 > g", turn=0), bash("echo a > f", turn=1), bash(BACKGROUND, turn=2),
                               bash(BACKGROUND, turn=3), final()])  # fmt: skip
    rule = Rule(after="echo 0", then_tool="bash", then_args={"command": READ}, probability=1.0, expected_seconds=1.0)
    spec = Speculation(predictors=[RulePredictor([rule])], policy=BoundedPolicy(), group=traj.task_id, early=True)
    done = anyio.Event()
    tools = builtin_tools()
    run_bash = next(t for t in tools if t.name == "bash").handler
    assert run_bash is not None

    async def handler(ws: Any, args: Any) -> Any:
        try:
            return await run_bash(ws, args)
        finally:
            if args["command"] == READ:
                done.set()

    on_tools = [msgspec.structs.replace(t, handler=handler) if t.name == "bash" else t for t in tools]
    async with serve([traj]) as client:
        gated = held_client(client, 2, done)  # the second answer: the turn that asks for the write
        try:
            async with Workspace() as ws:
                on = await agent_rollout(gated, f"replay:{traj.key}", ws, on_tools, spec, task_id=traj.task_id)
        finally:
            await gated.close()
        async with Workspace() as ws:
            off = await agent_rollout(client, f"replay:{traj.key}", ws, tools, None)
    assert on.metrics.wasted == 1 and on.metrics.committed == 0, on.metrics
    assert on.calls == off.calls


async def _next_pid(ws: Workspace) -> int:
    return int((await ws.exec(BACKGROUND)).stdout)


@pytest.mark.parametrize("used", [False, True])
async def test_a_read_in_place_puts_the_cursor_back_unless_used(used: bool) -> None:
    async with Workspace() as plain, Workspace() as ws:
        async with in_place(ws) as read:
            assert (await ws.exec("true; /bin/true")).ok  # bash and true: two pids
        if used:
            read.use()
            assert (await plain.exec("true; /bin/true")).ok  # what the plain loop ran
        assert await _next_pid(ws) == await _next_pid(plain)
        assert (ws._core.client.pids.settled, read.state) == ((0, "done") if used else (1, "back"))


async def test_a_read_put_back_then_used_goes_forward_again() -> None:
    # A dump (a fork for another guess at the same call) settles the read as unused: the copy starts from the
    # plain loop's cursor before the call; used afterwards, the rollout's cursor goes forward again.
    async with Workspace() as plain, Workspace() as before, Workspace() as ws:
        async with in_place(ws) as read:
            assert (await ws.exec("true; /bin/true")).ok
        (copy,) = await ws.fork(1)
        try:
            assert await _next_pid(copy) == await _next_pid(before)
        finally:
            await copy.aclose()
        read.use()
        assert (await plain.exec("true; /bin/true")).ok
        assert await _next_pid(ws) == await _next_pid(plain)
        assert ws._core.client.pids.forward == 1


FIFO = "mkfifo /tmp/go /tmp/went"


@pytest.mark.parametrize("other", ["guest", "request", "left"])
async def test_a_read_is_not_put_back_when_something_else_took_pids(other: str) -> None:
    # guest: a process of the workspace forks while the read runs; request: another call (not the read's) starts a
    # process meanwhile; left: the read leaves a process behind. The cursor then stays where it is: the read's and
    # the other's pids are not handed out again (a pid in use never is; the plain loop's numbering is lost).
    async with Workspace() as ws:
        assert (await ws.exec(FIFO)).ok
        if other == "guest":
            await ws.spawn("read x < /tmp/go; /bin/true; echo > /tmp/went")
        read_cmd = {"guest": "echo > /tmp/go; cat /tmp/went", "request": "cat /tmp/went",
                    "left": "sleep 100 >/dev/null 2>&1 &"}[other]  # fmt: skip
        scopes: list[ReadPids] = []
        async with anyio.create_task_group() as tg:
            if other == "request":  # another task's call (started outside the read's scope), once the read's runs
                tg.start_soon(_exec_once_running, ws, scopes, "/bin/true; echo > /tmp/went")
            async with in_place(ws) as read:
                scopes.append(read)
                assert (await ws.exec(read_cmd)).ok
        before = await _last_pid(ws)
        assert await _next_pid(ws) == before + 2  # bash, sleep: after everything, as without the read's scope
        pids = ws._core.client.pids
        assert (pids.settled, read.state) == (0, "done")


async def _exec_once_running(ws: Workspace, scopes: list[ReadPids], cmd: str) -> None:
    with anyio.fail_after(60):
        while not (scopes and scopes[0].own):  # the read's request is counted (it goes out without another await)
            await anyio.sleep(0.01)
    await ws.exec(cmd)


async def _last_pid(ws: Workspace) -> int:
    client = ws._core.live_client()
    value, _ = await anyio.to_thread.run_sync(exchange_last_pid, client.pid, client.pidfd)
    assert value is not None
    return value


async def test_a_used_read_keeps_its_pids_unless_a_cache_would_have_served_it(serve: Any) -> None:
    # The model asks for the read a branch ran in place: the plain loop ran it there too, so its pids stay (the next
    # `sleep & echo $!` prints the plain loop's pid). With a tool cache that would serve the call by the time the
    # model asks for it (a sibling recorded it meanwhile: ``Speculation.skip`` says so when the call is decided),
    # the plain loop with that cache runs no process for it: the read's pids go back as an unused read's (the
    # oracle's hf-model-inference #2 printed one pid more than fork+cache: four rollouts ran `ls -la` in place, where
    # fork+cache ran it once and served three from its cache).
    traj = trajectory("pids", [bash("echo 0 > g", turn=0), bash(READ, turn=1), bash(BACKGROUND, turn=2), final()])
    rule = Rule(after="echo 0", then_tool="bash", then_args={"command": READ}, probability=1.0, expected_seconds=1.0)
    tools = builtin_tools()
    run_bash = next(t for t in tools if t.name == "bash").handler
    assert run_bash is not None
    runs = []
    async with serve([traj]) as client:
        for served in (False, True):
            done = anyio.Event()

            async def handler(ws: Any, args: Any, done: anyio.Event = done) -> Any:
                try:
                    return await run_bash(ws, args)
                finally:
                    if args["command"] == READ:
                        done.set()

            def skip(launch: Any, done: anyio.Event = done, served: bool = served) -> bool:
                return served and done.is_set()  # not at its launch: by the time the model asks for it

            on_tools = [msgspec.structs.replace(t, handler=handler) if t.name == "bash" else t for t in tools]
            spec = Speculation(predictors=[RulePredictor([rule])], policy=BoundedPolicy(), group=traj.task_id,
                               early=True, skip=skip)  # fmt: skip
            gated = held_client(client, 2, done)  # the read's turn: asked for once the branch ran it
            try:
                async with Workspace() as ws:
                    runs.append(await agent_rollout(gated, f"replay:{traj.key}", ws, on_tools, spec,
                                                    task_id=traj.task_id))  # fmt: skip
            finally:
                await gated.close()
        async with Workspace() as ws:
            off = await agent_rollout(client, f"replay:{traj.key}", ws, tools, None)
    kept, served_run = runs
    assert kept.metrics.committed == 1 and served_run.metrics.committed == 1
    assert kept.calls == off.calls
    async with Workspace() as ws:  # how many pids the read takes
        first = await _last_pid(ws)
        assert (await ws.exec(READ)).ok
        took = await _last_pid(ws) - first
    assert took >= 1
    assert _pid_printed(kept) - _pid_printed(served_run) == took


def _pid_printed(run: Any) -> int:
    return int(run.calls[2].outcome.split()[-1])


async def test_a_read_in_place_starts_after_a_call_in_flight() -> None:
    # The main line's call runs (a read of the same message the model asked for first): a read run in place waits
    # for it, as the plain loop runs them one after the other, and so took its pids alone (put back unused). Had it
    # run beside the call, their pids would interleave and could not be put back. The call in flight blocks on a
    # fifo until the read is seen waiting for it (an order, not a sleep), and is then let go by another call.
    async with Workspace() as plain, Workspace() as ws:
        pids = ws._core.client.pids
        for w in (plain, ws):
            assert (await w.exec("mkfifo /tmp/go")).ok
        reads: list[ReadPids] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(ws.exec, "read x < /tmp/go; /bin/true")  # outside the read's scope
            with anyio.fail_after(60):
                while not pids.busy:
                    await anyio.sleep(0.01)
            tg.start_soon(_read_in_place, ws, reads)
            with anyio.fail_after(60):
                while not pids._idle.statistics().tasks_waiting:  # the read waits for the call in flight
                    await anyio.sleep(0.01)
            assert reads[0].own == 0 and pids.busy == 1  # its exec has not gone out
            assert (await ws.exec("echo > /tmp/go")).ok  # lets the call in flight end
        (read,) = reads
        assert read.alone
        async with anyio.create_task_group() as tg:  # what the plain loop ran (in whatever order: the count counts)
            tg.start_soon(plain.exec, "read x < /tmp/go; /bin/true")
            assert (await plain.exec("echo > /tmp/go")).ok
        assert await _next_pid(ws) == await _next_pid(plain)
        assert (pids.settled, read.state) == (1, "back")


async def _read_in_place(ws: Workspace, reads: list[ReadPids]) -> None:
    async with in_place(ws) as read:
        reads.append(read)
        assert (await ws.exec("true; /bin/true")).ok
