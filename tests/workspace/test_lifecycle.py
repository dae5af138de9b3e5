"""Creation and teardown: nothing of a workspace survives it, however it ends (the autouse leak check in
conftest asserts that after every test)."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from bunshin_async import Image, ImageError, Workspace, WorkspaceClosed, WorkspaceStartError
from bunshin_async._host import _client
from bunshin_async._workspace._facade import abandon_calls


async def test_closes_after_an_exception_inside() -> None:
    with pytest.raises(RuntimeError):
        async with Workspace() as ws:
            await ws.spawn("sleep 1000")
            raise RuntimeError("boom")
    assert ws.closed


async def test_cancelled_during_a_command() -> None:
    with anyio.move_on_after(0.5) as scope:
        async with Workspace() as ws:
            await ws.exec("sleep 1000")
    assert scope.cancelled_caught and ws.closed


@pytest.mark.parametrize("how", ["exec", "shell"])
async def test_a_cancelled_call_returns_once_its_command_is_gone(how: str) -> None:
    """The agent kills a cancelled call's command and waits until it is reaped, and the cancellation waits for
    that (the client's hang-up): the workspace's processes, read on the host the moment it returns, are those of
    before the call, and the workspace (and the shell session) lives on. Before, the cancellation returned at once
    and the command could still be exiting: a speculative read cancelled in place showed in the state read next
    (``BranchSet.quiesce`` waits for the read's task, which now ends after its processes)."""
    async with Workspace() as ws, ws.shell() as sh:
        assert ws.cgroup is not None
        await sh.run("X=kept")
        before = set(ws.cgroup.pids())
        # a process with 256 MiB to free when killed (its exit takes a while: the old client returned before it
        # ended, most of the time) and a sleep
        big = "b = b'x' * (256 << 20); open('/tmp/started', 'w').close(); import time; time.sleep(1000)"
        command = f'python3 -c "{big}" & sleep 1000; wait'
        async with anyio.create_task_group() as tg:
            tg.start_soon(ws.exec if how == "exec" else sh.run, command)
            with anyio.fail_after(60):  # a hang guard: the command and its two processes start
                while (await ws.exec("test -e /tmp/started")).exit_code:  # noqa: ASYNC110 - polls the guest
                    await anyio.sleep(0.02)
                while len(ws.cgroup.pids()) < len(before) + 2:  # noqa: ASYNC110 - polls the host's view
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert set(ws.cgroup.pids()) == before
        assert (await sh.run("echo $X")).stdout == "kept\n"


@pytest.mark.parametrize("abandoned", [False, True], ids=["lives-on", "abandoned"])
async def test_an_abandoned_workspaces_cancelled_call_does_not_wait_for_its_command(
    abandoned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workspace about to be closed (a discarded speculative fork: ``abandon_calls``) need not wait for its
    cancelled call's command to be reaped, its close kills everything: with the workspace frozen, so that its agent
    cannot answer the hang-up, such a call returns before the thaw; one of a workspace that lives on returns only
    once the agent has answered, after the thaw."""
    monkeypatch.setattr(_client, "HANG_UP_GRACE", 3600.0)  # only the agent's answer ends that wait
    order: list[str] = []
    returned = anyio.Event()
    async with Workspace() as ws:
        assert ws.cgroup is not None
        [freezer] = [d / "freezer.state" for d in ws.cgroup.dirs if (d / "freezer.state").exists()]
        scope = anyio.CancelScope()

        async def call() -> None:
            try:
                with scope:
                    await ws.exec("touch /tmp/started; sleep 1000")
            finally:
                order.append("returned")
                returned.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            with anyio.fail_after(60):  # hang guards: the command starts, the freeze completes
                while (await ws.exec("test -e /tmp/started")).exit_code:  # noqa: ASYNC110 - polls the guest
                    await anyio.sleep(0.02)
                freezer.write_text("FROZEN")
                while freezer.read_text().strip() != "FROZEN":  # noqa: ASYNC110 - polls the host's view
                    await anyio.sleep(0.005)
            try:
                if abandoned:
                    abandon_calls(ws)
                scope.cancel()
                if abandoned:
                    with anyio.move_on_after(30):  # a hang guard: it returns at once
                        await returned.wait()
                else:
                    await anyio.wait_all_tasks_blocked()  # the cancelled call waits on the frozen agent
            finally:
                order.append("thawed")
                freezer.write_text("THAWED")
    assert order == (["returned", "thawed"] if abandoned else ["thawed", "returned"])


@pytest.mark.parametrize("after", [0.0, 0.005, 0.02])
async def test_cancelled_during_start(after: float) -> None:
    ws = Workspace()
    with anyio.move_on_after(after):
        await ws.start()
        await ws.aclose()
    await ws.aclose()
    assert ws.closed


async def test_use_after_close_and_double_close() -> None:
    async with Workspace() as ws:
        pass
    await ws.aclose()
    with pytest.raises(WorkspaceClosed) as info:
        await ws.exec("true")
    assert info.value.workspace_id == ws.id
    with pytest.raises(WorkspaceClosed):
        await ws.read_file("x")
    with pytest.raises(WorkspaceClosed):
        await ws.start()


async def test_init_killed_from_outside() -> None:
    async with Workspace() as ws:
        assert ws.pid is not None
        os.kill(ws.pid, signal.SIGKILL)
        with pytest.raises(WorkspaceClosed):
            for _ in range(100):
                await ws.exec("true")
                await anyio.sleep(0.01)


async def test_missing_and_broken_images() -> None:
    with pytest.raises(ImageError) as info:
        Image.from_dir("/no/such/rootfs")
    assert info.value.image == "/no/such/rootfs"
    empty = Image(name="empty", rootfs="/var/empty-does-not-exist", digest="0")
    with pytest.raises(WorkspaceStartError):
        async with Workspace(image=empty):
            pass


async def test_an_image_needs_neither_python_nor_a_shell(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The agent is a static binary of the agent layer: an empty root is a valid image (tests/host/agent runs one).
    image = Image.from_dir(tmp_path)
    assert image.rootfs == str(tmp_path.resolve())


async def test_32_concurrent_workspaces() -> None:
    results: dict[int, str] = {}

    async def one(i: int) -> None:
        async with Workspace() as ws:
            await ws.write_file("id", str(i))
            results[i] = (await ws.exec("cat id; echo; hostname")).stdout

    async with anyio.create_task_group() as tg:
        for i in range(32):
            tg.start_soon(one, i)
    assert results == {i: f"{i}\nbunshin\n" for i in range(32)}


async def test_workspaces_are_isolated_from_each_other() -> None:
    async with Workspace() as a, Workspace() as b:
        await a.write_file("f", "a")
        with pytest.raises(Exception, match="no such file"):
            await b.read_file("f")
        pa = await a.spawn("sleep 1000")
        assert "sleep" not in (await b.exec("ps -eo comm")).stdout
        await pa.kill()


async def test_gc_removes_workspaces_of_a_dead_owner(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from bunshin_async._host import _paths
    from bunshin_async._workspace import _gc

    script = tmp_path / "owner.py"
    script.write_text(
        "import anyio, os, signal\n"
        "from bunshin_async import Workspace\n"
        "async def main():\n"
        "    ws = Workspace()\n"
        "    await ws.start()\n"
        "    await ws.exec('sleep 1000 &')\n"
        "    print(ws.id, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "anyio.run(main)\n"
    )
    # started first: this process's first start would collect the dead owner's workspace itself (_gc.reclaim)
    async with Workspace() as alive:
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        ws_id = proc.stdout.strip()
        assert ws_id and (_paths.workspaces_dir() / ws_id).exists()
        lines = _gc.collect()
        assert f"removed {ws_id}" in lines and f"kept {alive.id} (owner" in " ".join(lines)
    assert not (_paths.workspaces_dir() / ws_id).exists()
