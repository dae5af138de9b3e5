"""A subprocess SDK that SIGKILLs itself at one stage of a snapshot, fork, rollback or cache capture
(``python kill_driver.py STAGE``; the test gives it its own run dir, snapshot dir and cgroup parent). It prints
``ready <workspace pid>`` before the operation and ``criu <pid>`` for each CRIU it starts; it never prints anything
after the stage, it dies there."""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork import _quiesce, _restore  # noqa: E402
from bunshin_async._host import (
    _criu,  # noqa: E402
    _snapstore,
)
from bunshin_async._host._kernel import CGROUP_ROOT  # noqa: E402
from bunshin_async._workspace._core import WorkspaceCore  # noqa: E402
from bunshin_async.cache import ForkStateProvider  # noqa: E402
from tests.reliability.campaign import holding_workspace  # noqa: E402

STAGES = [
    "snapshot:drained",  # tool calls drained, CRIU started but not asked to dump yet
    "snapshot:criu",  # CRIU's dump running, the tree frozen and seized (nothing dumped yet)
    "snapshot:post-dump",  # in CRIU's post-dump notification: the tree is frozen, the upper dir being copied
    "snapshot:done",  # the snapshot is on the store, nobody closes it
    "fork:criu",  # CRIU's restore of a copy running (its namespaces made)
    "fork:frozen",  # the fork's dump at work with the tree frozen (CRIU stopped in post-dump, the freezer FROZEN)
    "fork:restored",  # a copy restored, the fork's snapshot not closed yet
    "rollback:stopped",  # the workspace's processes killed, its restore not started
    "rollback:criu",  # CRIU's restore into the workspace running (its namespaces made)
    "capture:post-dump",  # a cache capture's dump frozen in post-dump
    "capture:done",  # the cache holds the capture's snapshot
]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Reporting(_criu.SwrkCriu):
    """The real backend, printing each CRIU's pid (the test checks that none outlives the driver)."""

    def __init__(self, hook: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.pid = 0

        async def on_spawn(pid: int) -> None:
            print("criu", pid, flush=True)
            self.pid = pid
            if hook is not None:
                await hook(pid)

        super().__init__(on_spawn)


class Stopping(Reporting):
    """Dies in a dump's post-dump notification with CRIU stopped first, a CRIU still at work that cannot finish by
    itself (without its parent-death signal it stays so), and the tree frozen: CRIU has let go of the freezer by
    then (seize.c, ``freeze_processes``: it thaws once it has seized the tree), so the freezer state CRIU leaves when
    killed in its freeze window (a few milliseconds, up to its timeout for a task that does not freeze) is written
    here."""

    def __init__(self, freezer_state: Path) -> None:
        super().__init__()
        self.freezer_state = freezer_state

    async def call(self, req: Any, *, notify: Any = None, **kw: Any) -> Any:
        async def stop_then_die(name: str, pid: int) -> None:
            if name == "post-dump":
                os.kill(self.pid, signal.SIGSTOP)
                self.freezer_state.write_text("FROZEN")
                die()
            if notify is not None:
                await notify(name, pid)

        return await super().call(req, notify=stop_then_die, **kw)


async def main(stage: str) -> None:
    op, point = stage.split(":")
    _criu.default_backend = Reporting
    async with Workspace() as ws:
        await holding_workspace(ws, 8)
        base = await ws.snapshot() if op == "rollback" else None
        print("ready", ws.pid, flush=True)

        if point == "criu":

            class Dying(Reporting):
                """Dies in CRIU's notification ``at``: a dump's query-ext-files, which it sends once it has frozen and
                seized the tree (cr-dump.c, after collect_pstree); a restore's setup-namespaces, once it has made the
                copy's namespaces (its mount roots among them) and first task. CRIU waits for nothing more of us."""

                async def call(self, req: Any, *, notify: Any = None, **kw: Any) -> Any:
                    restore = req.type == _criu.rpc.RESTORE
                    if restore == (op == "snapshot"):  # a snapshot dies in its dump; a fork or rollback in a restore
                        return await super().call(req, notify=notify, **kw)
                    req.opts.notify_scripts = True  # setup-namespaces is a script action; query-ext-files always comes
                    kw["env"] = {k: v for k, v in (kw.get("env") or {}).items() if k != "CRIU_NOTIFY_ONLY"}
                    at = "setup-namespaces" if restore else "query-ext-files"

                    async def hook(name: str, pid: int) -> None:
                        if name == at:
                            die()
                        if notify is not None:
                            await notify(name, pid)

                    return await super().call(req, notify=hook, **kw)

            _criu.default_backend = Dying
        if point == "frozen":  # the driver's cgroup parent has no run scope
            state = CGROUP_ROOT / "freezer" / os.environ["BUNSHIN_CGROUP_PARENT"] / f"ws-{ws.id}" / "freezer.state"
            _criu.default_backend = functools.partial(Stopping, state)
        if point == "drained":
            real_drain = _quiesce.drain

            async def drain(w: WorkspaceCore) -> Any:
                await real_drain(w)
                die()

            _quiesce.drain = drain  # type: ignore[assignment]
        if point == "post-dump":
            real_finish = _snapstore.TreeCopy.finish

            async def finish(self: _snapstore.TreeCopy) -> None:  # the dump's upper dir copied, the tree frozen
                await real_finish(self)
                die()

            _snapstore.TreeCopy.finish = finish  # type: ignore[method-assign]
        if point == "restored":
            real_restore = _restore.restore_into

            async def restore_into(w: WorkspaceCore, snap: Snapshot, backend: Any = None) -> None:
                await real_restore(w, snap, backend)
                die()

            _restore.restore_into = restore_into  # type: ignore[assignment]
        if point == "stopped":
            real_stop = _restore._stop_processes

            async def stop(w: WorkspaceCore, keep_client: bool = False) -> None:
                await real_stop(w, keep_client)
                die()

            _restore._stop_processes = stop  # type: ignore[assignment]

        if op == "snapshot":
            await ws.snapshot()
        elif op == "fork":
            await ws.fork(2)
        elif op == "rollback":
            assert base is not None
            await ws.rollback(base)
        elif op == "capture":
            await ForkStateProvider().capture(ws)
        die()  # "done": the operation finished and nothing is closed


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
