"""Rollback restores the exact state; a CRIU killed mid-dump or mid-restore leaves the parent running, no half-made
copy, and a clear ForkError."""

from __future__ import annotations

import errno
import os
import re
import signal
from typing import Any

import anyio
import pytest

from bunshin_async import ForkError, Workspace
from bunshin_async._compat import BaseExceptionGroup
from bunshin_async._fork import _dump, _restore
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import NotifyHandler, SwrkCriu


async def test_rollback_returns_exact_state(ws: Workspace, fork_mode: str) -> None:
    await ws.write_file("/workspace/f", "v1")
    sh = ws.shell()
    await sh.open()
    await sh.run("cd /tmp && X=1")
    await ws.spawn("python3 -c 'import time; x=list(range(10**6)); time.sleep(10**6)'")
    ident, directory = ws.id, ws.directory
    before = (await ws.exec("ps -eo pid,args --no-headers | sort")).stdout
    async with await ws.snapshot() as snap:
        await ws.write_file("/workspace/f", "v2")
        await ws.write_file("/workspace/new", "x")
        await sh.run("cd / && X=2")
        await ws.exec("pkill -f 'x=list' || true; touch /etc/garbage")
        await ws.rollback(snap)
        assert ws.fork_mode == fork_mode
        assert (ws.id, ws.directory) == (ident, directory)
        assert await ws.read_text("/workspace/f") == "v1"
        assert (await ws.exec("ls /workspace/new /etc/garbage")).exit_code != 0
        assert (await sh.run('echo "$X $(pwd)"')).stdout == "1 /tmp\n"
        assert (await ws.exec("ps -eo pid,args --no-headers | sort")).stdout.count("x=list") == before.count("x=list")
        # A second rollback to the same snapshot works too.
        await ws.write_file("/workspace/f", "v3")
        await ws.rollback(snap)
        assert await ws.read_text("/workspace/f") == "v1"


class KillCriuAt(SwrkCriu):
    """Fault injection at the backend interface: SIGKILL CRIU when it reaches notification ``point``. ``log`` is
    what CRIU had logged then, at level 4."""

    def __init__(self, point: str) -> None:
        super().__init__(on_spawn=self._spawned)
        self.point = point
        self.pid = 0
        self.killed = False
        self.log = ""

    async def _spawned(self, pid: int) -> None:
        self.pid = pid

    async def call(self, req: Any, *, notify: NotifyHandler | None = None, **kw: Any) -> Any:
        req.opts.notify_scripts = True
        req.opts.log_level = 4
        # every notification, also those the SDK does not ask for (criu/patches/0030): network-unlock is a point
        kw["env"] = {k: v for k, v in (kw.get("env") or {}).items() if k != "CRIU_NOTIFY_ONLY"}

        async def hook(name: str, pid: int) -> None:
            if notify is not None:
                await notify(name, pid)
            if name == self.point:
                self.log = (kw["work_dir"] / kw["log_name"]).read_text(errors="replace")
                self.killed = True
                os.kill(self.pid, signal.SIGKILL)
                await anyio.sleep(0.1)

        return await super().call(req, notify=hook, **kw)


@pytest.mark.parametrize("point", ["post-dump", "network-unlock"])
async def test_criu_killed_mid_dump(ws: Workspace, point: str) -> None:
    # Written by rename: a read never sees the file truncated but not yet written.
    tick = "i=$((i+1)); echo $i >/workspace/t; mv /workspace/t /workspace/tick"
    await ws.spawn(f"i=0; while true; do {tick}; sleep 0.02; done")
    backend = KillCriuAt(point)
    with pytest.raises(ForkError) as info:
        await _dump.snapshot(ws._core, backend)
    assert backend.killed or point == "network-unlock"
    assert "criu dump" in str(info.value) and info.value.workspace_id == ws.id
    if point == "post-dump":  # the first line says how CRIU ended
        assert "criu dump died (killed by SIGKILL" in str(info.value).splitlines()[0]
    # The parent is thawed and keeps running.
    first = int(await ws.read_text("/workspace/tick"))
    with anyio.fail_after(5):
        while int(await ws.read_text("/workspace/tick")) <= first:
            await anyio.sleep(0.05)
    assert await ws.ping() > 0


@pytest.mark.parametrize("point", ["setup-namespaces", "post-restore"])
async def test_criu_killed_mid_restore(ws: Workspace, point: str) -> None:
    await ws.write_file("/workspace/f", "x")
    async with await ws.snapshot() as snap:
        rundir = ws.directory.parent
        before = set(rundir.iterdir())
        record = record_of(snap)
        victim = _restore.new_core(record)
        backend = KillCriuAt(point)
        with pytest.raises(ForkError) as info:
            await _restore.restore_into(victim, record, backend)
        assert backend.killed
        assert "criu restore" in str(info.value)
        assert victim.state == "closed" and not victim.dir.exists()
        assert set(rundir.iterdir()) == before
        # CRIU had made its mount roots (mount.c, create_mnt_roots): /tmp/.criu.mntns.XXXXXX, which a killed or
        # failed restore left on the host, is on a tmpfs of the restore's own mount namespace (criu/patches/0037)
        roots = set(re.findall(r"@ (/\S*?/\.criu\.mntns\.\w{6})/", backend.log))
        assert roots
        assert not [r for r in roots if os.path.lexists(r)]
        # The snapshot is still good, and so is the parent.
        (ok,) = await Workspace.from_snapshot(snap)
        try:
            assert await ok.read_text("/workspace/f") == "x"
        finally:
            await ok.aclose()
    assert await ws.read_text("/workspace/f") == "x"


async def test_cancelled_fork_leaves_nothing(ws: Workspace) -> None:
    with anyio.move_on_after(0.05):
        await ws.fork(4)
    assert await ws.ping() > 0
    (child,) = await ws.fork()
    await child.aclose()


async def test_snapshot_cancelled_while_draining_reopens_the_workspace(ws: Workspace) -> None:
    async with anyio.create_task_group() as tg:
        # the command runs until /tmp/hold is gone, which nothing removes before the snapshot is cancelled
        tg.start_soon(ws.exec, "touch /tmp/hold /tmp/running; while [ -e /tmp/hold ]; do sleep 0.05; done")
        with anyio.fail_after(30):  # the command runs (not: 0.2 s have passed)
            while (await ws.exec("test -e /tmp/running")).exit_code:  # noqa: ASYNC110 - polls the guest
                await anyio.sleep(0.02)
        with anyio.move_on_after(0.3) as scope:  # the command holds the drain: the snapshot cannot be done
            await ws.snapshot()  # waits for the running command, then is cancelled
        assert scope.cancelled_caught
        with anyio.fail_after(10):  # reopened: the command ends
            await ws.exec("rm /tmp/hold")
    with anyio.fail_after(10):
        assert (await ws.exec("echo still-usable")).stdout == "still-usable\n"


@pytest.mark.fork_modes("criu-cow")
async def test_a_copy_failing_with_a_host_error_fails_the_fork_with_fork_error(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy whose restore fails with something that is no ``ForkError`` (here an ``OSError`` taking its layer
    references) fails the fork with ``ForkError`` naming that failure, caused by the group: a caller that falls back
    on ``ForkError`` (the tool cache runs the call instead) never meets a bare exception group. Nothing of the two
    copies is left and the snapshot still serves."""
    real, failed = _restore.hold_layers, []

    def hold_layers(layers: list[Any], user: str) -> None:
        if not failed:
            failed.append(user)
            raise OSError(errno.EIO, "Input/output error")
        real(layers, user)

    rundir = ws.directory.parent
    before = set(rundir.iterdir())
    async with await ws.snapshot() as snap:
        monkeypatch.setattr(_restore, "hold_layers", hold_layers)
        with pytest.raises(ForkError, match=r"OSError: \[Errno 5\] Input/output error") as info:
            await Workspace.from_snapshot(snap, 2)
        assert isinstance(info.value.__cause__, BaseExceptionGroup)
        assert failed and set(rundir.iterdir()) == before
        (ok,) = await Workspace.from_snapshot(snap)
        await ok.aclose()
