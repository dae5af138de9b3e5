"""The pre-copy pass before a write-tracked snapshot (``precopy``), and the CPU account every dump's CRIU runs in
(``cpu_account``); ``_dump`` takes the snapshots."""

from __future__ import annotations

import itertools
import logging
import os
import secrets
from pathlib import Path

import anyio

from .._exceptions import ForkError
from .._host import _criu, _kernel, _paths, _wptrack
from .._host._criu import CriuBackend, rpc
from .._host._snapstore import hold_layers, release_layers, store_lock
from .._workspace._core import WorkspaceCore
from . import _restore
from ._modes import dump_env
from ._record import SnapshotRecord

log = logging.getLogger("bunshin_async.fork")

FREEZE_TIMEOUT = 10
"""Seconds CRIU may take to freeze and seize the tree (its ``timeout`` option): a process that cannot be frozen
fails the snapshot, named (``_dump._undumpable``), once its retry (``_dump.FREEZE_RETRIES``) has failed the same
way."""
DUMP_TIMEOUT = 120.0
_n = itertools.count()


def cpu_account() -> tuple[_kernel.Cgroup | None, list[str]]:
    """A CPU-accounting cgroup under the run's parent for one CRIU call and the wrapper that joins it (none without
    CPU accounting). Made without an await (a mkdir); the caller destroys it once CRIU is reaped."""
    account = _kernel.Cgroup.make_cpu_account(f"criu-dump-{os.getpid()}-{next(_n)}")
    if account is None:
        return None, []
    return account, [str(_paths.init_binary()), "--join", *_restore.cgroup_joins(account), "--"]


async def precopy(ws: WorkspaceCore, snap: SnapshotRecord, backend: CriuBackend) -> Path | None:
    """A pre-copy pass before a write-tracked snapshot that has no parent to be incremental on: ``criu pre-dump``
    (``VM_READ``: the tree is frozen only to list and arm its memory, its pages are read after the thaw) into a
    directory beside the snapshot's, which the snapshot's dump is then incremental on, so that its freeze copies
    only what was written meanwhile (criu/patches/0013). The directory, held by the snapshot, or ``None`` when the
    pass failed (the dump is then whole; tracking dropped)."""
    assert ws.pid is not None
    pre = await anyio.to_thread.run_sync(_precopy_dir, snap)
    freezer = ws.cgroup.freezer_dir if ws.cgroup is not None else None
    req = rpc.criu_req(type=rpc.PRE_DUMP)
    _criu.base_opts(req)
    req.opts.pid = ws.pid
    req.opts.pre_dump_mode = rpc.VM_READ
    req.opts.network_lock = rpc.SKIP
    req.opts.notify_scripts = True  # the uffds come in wp-uffd notifications
    req.opts.timeout = FREEZE_TIMEOUT
    if freezer is not None:
        req.opts.freeze_cgroup = str(freezer)
    uffds: list[int] = []
    refused = False  # bounded as a dump's are (``_dump``)

    def on_fd(name: str, pid: int, fd: int) -> None:
        nonlocal refused
        if name == "wp-uffd" and not refused:
            if ws.tracking.room(len(uffds)) and _wptrack.is_uffd(fd):
                uffds.append(fd)
                return
            refused = True
        os.close(fd)

    # CRIU's CPU is the run's, as the dump's is (``_dump``)
    account, wrapper = cpu_account()
    fd = -1
    try:
        fd = os.open(pre / "images", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        req.opts.images_dir_fd = fd
        with anyio.CancelScope(shield=True):  # as the dump: never kill CRIU while its parasite runs
            await backend.call(
                req,
                work_dir=pre / "images",
                log_name="pre-dump.log",
                workspace_id=ws.id,
                env={**dump_env(), "CRIU_WP_TRACK": "1", "CRIU_NOTIFY_ONLY": ""},  # wp-uffd only (0030)
                wrapper=wrapper,
                timeout=DUMP_TIMEOUT,
                on_fd=on_fd,
            )
        if refused:
            raise ForkError(f"workspace {ws.id}: too many uffds to hold", workspace_id=ws.id)
    except ForkError as exc:
        await _wptrack.close_fds(ws.tracking.take() + uffds)
        await anyio.to_thread.run_sync(_drop_precopy, snap, pre)
        log.warning("workspace %s: pre-copy failed, the snapshot is a whole dump: %s", ws.id, exc)
        return None
    except BaseException:
        await _wptrack.close_fds(ws.tracking.take() + uffds)
        raise  # the caller removes the snapshot, and with it the pre-copy it holds
    finally:
        if fd >= 0:
            os.close(fd)
        if account is not None:
            with anyio.CancelScope(shield=True):
                await account.destroy()
    ws.tracking.adopt(uffds, pre)  # a failed dump on it drops them (``_dump``)
    return pre


def _precopy_dir(snap: SnapshotRecord) -> Path:
    """A snapshot directory's sibling for its pre-copy, held by it (its ``parent``; blocking)."""
    pre = snap.path.with_name(secrets.token_hex(6))
    with store_lock():
        (pre / "images").mkdir(parents=True)
        hold_layers([pre], f"child-{snap.id}")
    (snap.path / "parent").write_text(pre.name)
    return pre


def _drop_precopy(snap: SnapshotRecord, pre: Path) -> None:
    (snap.path / "parent").unlink(missing_ok=True)
    release_layers([pre], f"child-{snap.id}")
