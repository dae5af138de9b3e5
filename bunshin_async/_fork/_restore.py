"""Restoring copies: ``copies`` (warm spares first, then ``restore_many``), ``restore_into`` (a CRIU restore, or
a filesystem-only cold start, into a new core) and ``rollback`` (the same into a live workspace's own core)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import anyio

from .._compat import BaseExceptionGroup
from .._exceptions import BunshinError, ForkError, InvalidValue, describe
from .._host import _criu, _paths, _snapstore, _tree, _userns
from .._host._criu import CriuBackend, rpc
from .._host._kernel import Cgroup, task_status
from .._host._snapstore import MAX_LAYERS, MAX_MEM_CHAIN, chain_layers, hold_layers, release_layers, store_full
from .._workspace._core import WorkspaceCore, prime_attach
from ._modes import ksm_enable, mode_wrapper, restore_mode
from ._quiesce import coordinator
from ._record import SnapshotRecord

__all__ = ["copies", "rebase", "restore_into", "rollback"]

RESTORE_TIMEOUT = 120.0

NET_KEY = "bunshin-net"
NET_FD = 9
"""``--external net[ino]:NET_KEY`` at the dump; at the restore CRIU inherits the fresh namespace on fd ``NET_FD``."""
FRESH_NETNS = "fresh-netns"
"""The feature criu/patches/0011 adds: with ``CRIU_FRESH_NETNS=NET_KEY`` in its environment the restored tree makes
its fresh net namespace itself (loopback up) instead of inheriting one. A tree restored into its own user namespace
(``Security.userns``) cannot join one the wrapper made: that one is owned by the host's user namespace (setns(2))."""


def cgroup_joins(cgroup: Cgroup) -> list[str]:
    """``bunshin-init``'s arguments that join ``cgroup`` (``--cgroup PROCS_FILE`` per hierarchy)."""
    return [arg for p in cgroup.procs_files for arg in ("--cgroup", str(p))]


def _wrapper(cgroup: Cgroup, lower: str, upper: Path, work: Path, root: Path, fresh_net: bool = False) -> list[str]:
    """``bunshin-init --restore-wrap`` (native/init.c) gives the restore a private mount namespace (no host mount,
    nothing to clean up if we die), joins the cgroup and mounts the root overlay there, and a tmpfs for CRIU's mount
    roots (which CRIU left in /tmp after every failed or killed restore), then execs CRIU (same pid: still our
    child). With ``fresh_net`` it also makes a new net namespace, brings its loopback up and hands it to CRIU on
    ``NET_FD``."""
    opts = f"lowerdir={lower},upperdir={upper},workdir={work},index=on,nfs_export=on"
    joins = cgroup_joins(cgroup)
    net = ["--net"] if fresh_net else []
    roots = ["--mnt-roots", str(_paths.criu_roots_dir())]
    return [
        str(_paths.init_binary()),
        "--restore-wrap",
        *net,
        *joins,
        *roots,
        "--overlay",
        opts,
        "--root",
        str(root),
        "--",
    ]


def _strays(cgroup: Cgroup) -> list[int]:
    """Kill what a failed restore left in the cgroup; return those that are our children in another pid namespace
    (a restored root task, through rst_sibling). CRIU itself is in the cgroup too (the restore wrapper joined it)
    and our child, but the CRIU backend reaps it: reaping it here made asyncio's child watcher report a lost
    child."""
    ours = []
    for pid in cgroup.pids():
        status = task_status(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        if status is not None and _restored_child(status):
            ours.append(pid)
    return ours


def _restored_child(status: dict[str, str]) -> bool:
    """Whether a task is our child in another pid namespace (a restored root task, through rst_sibling)."""
    return status.get("PPid") == str(os.getpid()) and len(status.get("NSpid", "").split()) > 1


def _dead_restored_children() -> list[int]:
    """Our zombie children in another pid namespace: a restored root task (our child through rst_sibling) that
    died with a failed restore has left its cgroup already, so ``_strays`` cannot see it (blocking)."""
    pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    return [
        pid for pid in pids if (s := task_status(pid)) and s.get("State", "").startswith("Z") and _restored_child(s)
    ]


async def _reap_strays(cgroup: Cgroup) -> None:
    strays = _strays(cgroup)
    for pid in strays:
        try:
            await anyio.to_thread.run_sync(os.waitpid, pid, 0)
        except ChildProcessError:
            pass
    for pid in await anyio.to_thread.run_sync(_dead_restored_children):
        try:
            os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG on a zombie
        except ChildProcessError:
            pass


async def restore_into(ws: WorkspaceCore, snap: SnapshotRecord, backend: CriuBackend | None = None) -> None:
    """Make ``ws`` (state "new", no directory yet) a live copy of ``snap`` (a filesystem-only one for an fs snapshot
    or mode). On failure everything made for it is removed and the error (``ForkError`` for CRIU failures and failed
    restarts) raised."""
    if snap.closed:
        raise ForkError(f"snapshot {snap.id} is closed", workspace_id=ws.id)
    ws.state = "starting"
    try:
        async with ws.failing_closes():
            await ws.make_dirs(upper=False)
            # The cgroup first: the priming attach holds cgroup_mutex through its grace period, and a cgroup-v1
            # mkdir waits for that mutex (it took 3-13 ms here when made after the prime).
            ws.create_cgroup()
            prime_attach()
            await _upper_from(ws, snap)
            await _restore(ws, snap, backend or _criu.default_backend())
            ws.state = "running"
    except OSError as exc:
        if (full := store_full(exc, ws.id, dump=False)) is not None:
            raise full from exc
        raise


async def rollback(ws: WorkspaceCore, snap: SnapshotRecord, backend: CriuBackend | None = None) -> None:
    """Replace the processes and files of ``ws`` by the snapshot's; ``ws`` keeps its id, directory and cgroup. If
    the restore fails the workspace is closed (its old state is already gone) and ``ForkError`` raised. Waits for
    a snapshot of ``ws`` in progress (and the other way round)."""
    async with coordinator(ws).lock:
        await _rollback(ws, snap, backend)


async def _rollback(ws: WorkspaceCore, snap: SnapshotRecord, backend: CriuBackend | None) -> None:
    if ws.state != "running":
        raise ws.closed_error()
    if snap.closed:
        raise ForkError(f"snapshot {snap.id} is closed", workspace_id=ws.id)
    ws.state = "starting"
    await _replace(ws, snap, backend or _criu.default_backend())
    ws.state = "running"


async def rebase(ws: WorkspaceCore, snap: SnapshotRecord, backend: CriuBackend) -> None:
    """Restore ``ws`` in place from ``snap``, a whole dump of it that ended its tree (``leave_running`` off), as a
    CoW copy of ``snap``: a copy whose image chain is ``MAX_MEM_CHAIN`` deep cannot dump incrementally on it, and it
    then maps ``snap``'s one image, so that its later dumps are incremental again (``_dump._rebases``). What runs
    inside sees nothing but time pass (the dump and restore are CRIU's); calls held by the snapshot's drain go to
    the restored agent. Called with the workspace drained and the coordinator's lock held; a failed restore closes
    the workspace, as a failed rollback does."""
    t0 = time.monotonic()
    await _replace(ws, snap, backend, keep_client=True)
    snap.rebase_ms = (time.monotonic() - t0) * 1000


async def _replace(ws: WorkspaceCore, snap: SnapshotRecord, backend: CriuBackend, keep_client: bool = False) -> None:
    """Replace the processes and files of ``ws`` by ``snap``'s (``rollback``, ``rebase``); on failure ``ws`` is
    closed."""
    async with ws.failing_closes():
        prime_attach()
        with anyio.CancelScope(shield=True):
            await _stop_processes(ws, keep_client)
        await anyio.to_thread.run_sync(_tree.remove_tree, ws.dir / "upper")
        await anyio.to_thread.run_sync(_tree.remove_tree, ws.dir / "work")
        (ws.dir / "work").mkdir()
        if ws.spec.security.userns:
            _userns.chown_root(ws.dir / "work")
        await _upper_from(ws, snap)
        await _restore(ws, snap, backend)


async def _upper_from(ws: WorkspaceCore, snap: SnapshotRecord) -> None:
    """Give ``ws`` (no upper dir yet, processes stopped) the snapshot's files: an empty upper over the snapshot's
    layer chain, or, past ``MAX_LAYERS``, a copy of the top layer over the rest. ``ws`` takes its references on the
    new chain first, then lets go of its old one."""
    lower = snap.lower
    await snap.materialize()
    if len(lower.split(":")) > MAX_LAYERS:
        lower = snap.parent_lower
        await _snapstore.copy_tree(snap.layer, ws.dir / "upper", workspace_id=ws.id)
    else:
        (ws.dir / "upper").mkdir()
        if ws.spec.security.userns:
            _userns.chown_root(ws.dir / "upper")
    old = chain_layers(ws.lower or "")
    new = chain_layers(lower)
    ws.lower = lower  # from here teardown lets go of the new chain

    def swap() -> None:  # one worker-thread call, not cancelled midway
        try:
            hold_layers(new, ws.id)
        finally:
            release_layers([p for p in old if p not in new], ws.id)

    await anyio.to_thread.run_sync(swap)


async def _stop_processes(ws: WorkspaceCore, keep_client: bool = False) -> None:
    """Kill the tree of ``ws`` and reap its pid 1 (or shim), leaving directory and cgroup in place."""
    await ws.stop_processes(keep_client=keep_client)
    if ws.cgroup is not None:  # stragglers outside pid 1's namespace cannot exist, but be exact
        ws.cgroup.kill_all()
        delay = 0.0005
        while ws.cgroup.pids():
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.05)


async def _restore(ws: WorkspaceCore, snap: SnapshotRecord, backend: CriuBackend) -> None:
    assert ws.cgroup is not None

    def choose() -> str:  # the memory mode and the snapshot the copy maps, in one worker-thread call
        mode = "fs" if snap.mode == "fs" else restore_mode()
        ws.map_from(snap.path if mode == "criu-cow" else None)
        return mode

    mode = await anyio.to_thread.run_sync(choose)
    if mode == "fs":
        await _restart(ws, snap)
        return
    if mode == "criu-ksm":
        await anyio.to_thread.run_sync(ksm_enable)
    req = rpc.criu_req(type=rpc.RESTORE)
    _criu.base_opts(req)
    req.opts.root = str(ws.dir / "root")
    req.opts.rst_sibling = True
    own_net = snap.fresh_net and snap.spec.security.userns  # made by CRIU in the copy's user namespace (FRESH_NETNS)
    if snap.fresh_net and not own_net:
        req.opts.inherit_fd.add(key=NET_KEY, fd=NET_FD)
    fd = os.open(snap.images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        req.opts.images_dir_fd = fd
        assert ws.lower is not None
        env, prefix = mode_wrapper(mode)
        if own_net:
            env = {**env, "CRIU_FRESH_NETNS": NET_KEY}
        wrapper = prefix + _wrapper(
            ws.cgroup, ws.lower, ws.dir / "upper", ws.dir / "work", ws.dir / "root", snap.fresh_net and not own_net
        )
        t0 = time.monotonic()
        try:
            resp = await backend.call(
                req,
                work_dir=ws.dir,
                log_name="restore.log",
                workspace_id=ws.id,
                wrapper=wrapper,
                env=env,
                timeout=RESTORE_TIMEOUT,
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _reap_strays(ws.cgroup)
            raise
    finally:
        os.close(fd)
    ws.restore_ms = (time.monotonic() - t0) * 1000
    await ws.adopt(int(resp.restore.pid))
    ws.fork_mode = mode
    ws.setup, ws.restarted = list(snap.setup), []  # carried, with their pids
    if ws.mem_parent is not None:
        await anyio.to_thread.run_sync(_let_go_unless_mapped, ws)


def _let_go_unless_mapped(ws: WorkspaceCore) -> None:
    """A CoW restore maps only runs of at least 16 pages of plain anonymous memory (criu/patches/0001,
    ``COW_MIN_PAGES``) and reads the rest: a copy of a small workspace (a shell, an agent) may map nothing. Such a
    copy's memory is private, its dumps gain nothing from its snapshot's images (every restored page is soft-dirty,
    so CRIU writes them all again), and holding the snapshot's directory for it would keep the whole directory (and,
    through the incremental chain of its own snapshots, every earlier one) for the rest of its life. So it lets go
    at once (blocking; after ``adopt``). Mapped images are recognised by device and inode, not by name: a process
    inside cannot map the store's files, only keep what the restore mapped."""
    assert ws.mem_parent is not None and ws.cgroup is not None
    images: set[tuple[int, int, int]] = set()
    cur: Path | None = ws.mem_parent
    for _ in range(MAX_MEM_CHAIN + 1):  # the images a restore maps from: its snapshot's and those it is incremental on
        if cur is None:
            break
        for page_image in (cur / "images").glob("pages-*.img"):
            with contextlib.suppress(OSError):
                st = page_image.stat()
                images.add((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
        cur = _snapstore.mem_parent_of(cur)
    if not any(_maps_any(pid, images) for pid in ws.cgroup.pids()):
        ws.map_from(None)


def _maps_any(pid: int, files: set[tuple[int, int, int]]) -> bool:
    """Whether ``pid`` maps one of ``files`` ((major, minor, inode)); a process gone counts as not (blocking)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) >= 5 and fields[4] != b"0":
                    major, minor = (int(x, 16) for x in fields[3].split(b":"))
                    if (major, minor, int(fields[4])) in files:
                        return True
    except (OSError, ValueError):
        pass
    return False


async def _restart(ws: WorkspaceCore, snap: SnapshotRecord) -> None:
    """Filesystem-only restore into ``ws`` (directory, upper over the snapshot's chain and cgroup made, no process):
    a cold start of bunshin-init, then the snapshot's recorded spawns again, in their order. Failures are
    ``ForkError``; the caller tears down what was made."""
    t0 = time.monotonic()
    ws.setup, ws.restarted = [], []
    try:
        await ws.spawn()
    except (BunshinError, OSError) as exc:
        why = f"workspace {ws.id}: cold start of a filesystem-only copy failed: {exc}"
        raise ForkError(why, workspace_id=ws.id) from exc
    ws.state = "running"  # tool calls are allowed from here; on failure the caller closes it
    for step, _pid in snap.setup:
        try:
            ws.restarted.append((step, await ws.start_step(step)))
        except BunshinError as exc:
            raise ForkError(f"workspace {ws.id}: restarting `{step}` failed: {exc}", workspace_id=ws.id) from exc
    ws.restore_ms = (time.monotonic() - t0) * 1000
    ws.fork_mode = "fs"


def new_core(snap: SnapshotRecord) -> WorkspaceCore:
    """The factory of copies: a not-yet-started core with the configuration ``snap`` recorded."""
    return WorkspaceCore(snap.spec.detached())


async def copies(snap: SnapshotRecord, n: int) -> list[WorkspaceCore]:
    """``n`` new live copies of ``snap`` (``Workspace.from_snapshot``): warm spares first, thawed, the rest
    restored now. All or nothing: if one fails the others are closed and the error (``ForkError``) raised."""
    if n < 1:
        raise InvalidValue("n must be at least 1", argument="n")
    if snap.closed:
        raise ForkError(f"snapshot {snap.id} is closed", workspace_id=snap.workspace_id)
    spares = snap.spares.take(n) if snap.spares is not None else []
    if len(spares) == n:
        return spares
    try:
        return spares + await restore_many(snap, n - len(spares))
    except BaseException:
        with anyio.CancelScope(shield=True):
            for ws in spares:
                await ws.aclose()
        raise


async def restore_many(snap: SnapshotRecord, n: int) -> list[WorkspaceCore]:
    """``n`` copies restored concurrently; all or nothing, the first ``ForkError`` raised out of the group. A copy
    that failed otherwise (an ``OSError`` of the host, another ``BunshinError``) is a ``ForkError`` too, its cause
    the group: a caller that serves a fork or falls back on ``ForkError`` (the tool cache executes the call
    instead) must not see a bare exception group (a fork+cache rollout failed so, session 17). Cancellation and
    ``KeyboardInterrupt`` pass as they are."""
    made = [new_core(snap) for _ in range(n)]
    try:
        async with anyio.create_task_group() as tg:
            for ws in made:
                tg.start_soon(restore_into, ws, snap)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            for ws in made:
                await ws.aclose()
        if not isinstance(exc, BaseExceptionGroup):
            raise
        fork_errors = [e for e in exc.exceptions if isinstance(e, ForkError)]
        if fork_errors:
            raise fork_errors[0] from exc
        if all(isinstance(e, Exception) for e in exc.exceptions):  # failures only: nothing cancelled or interrupted
            why = f"restoring a copy of snapshot {snap.id} failed: {describe(exc)}"
            raise ForkError(why, workspace_id=snap.workspace_id) from exc
        raise
    return made
