"""Taking snapshots: ``snapshot`` (a CRIU dump of the drained tree, the upper dir copied in ``post-dump``, or a
filesystem-only copy under the freezer) and ``fork`` (concurrent calls coalesced on one dump, each restoring its own
copies)."""

from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from .._exceptions import ForkError, InvalidValue
from .._host import _criu, _pidns, _snapstore, _wptrack
from .._host._client import AgentClient
from .._host._criu import CriuBackend, rpc
from .._host._kernel import task_status
from .._host._snapstore import (
    MAX_MEM_CHAIN,
    chain_layers,
    hold_layers,
    mem_chain_depth,
    store_full,
    store_lock,
)
from .._host._wptrack import tracking_wanted
from .._images._image import agent_layer
from .._workspace._core import WorkspaceCore
from . import _quiesce, _restore
from ._modes import dump_env, fs_only
from ._precopy import DUMP_TIMEOUT, FREEZE_TIMEOUT, cpu_account, precopy
from ._quiesce import Batch, Coordinator, coordinator
from ._record import SnapshotRecord
from ._restore import FRESH_NETNS, NET_KEY
from ._snapshot import Snapshot

__all__ = ["fork", "snapshot"]

FREEZE_RETRIES = 1
"""Dumps taken again after CRIU failed to freeze the tree (``_snapshot``)."""
OVERLAP = True
"""Overlap a dump's fixed costs with what runs anyway: its CRIU is started before the workspace is drained
(``CriuBackend.call``'s ``ready``: CRIU's start, 10-25 ms here, is not part of the workspace's pause), and the upper
dir is copied beside CRIU's dump from the freeze on (``_snapstore.TreeCopy``), not after it. ``False`` runs both in
sequence, as before (bench/fork_bench's ``+serial`` modes measure the difference side by side)."""


async def fork(ws: WorkspaceCore, n: int) -> list[WorkspaceCore]:
    """``n`` copies of ``ws`` as it is now. Concurrent calls on one workspace are coalesced: those that arrive
    while no dump of it has started share the next one (16 concurrent ``fork(1)`` take one dump, or two when the
    first had started already), and each restores its own copies from it, so one caller's failed or cancelled
    restore does not touch the others. A call that joined a batch whose taker was cancelled joins the next one."""
    if n < 1:
        raise InvalidValue("n must be at least 1", argument="n")
    coord = coordinator(ws)
    while True:
        batch = coord.open
        lead = batch is None
        if batch is None:
            batch = coord.open = Batch()
        batch.users += 1
        try:
            if lead:
                await _take(ws, coord, batch)
            else:
                await batch.taken.wait()
            if batch.error is not None:
                if isinstance(batch.error, anyio.get_cancelled_exc_class()):
                    continue  # its taker was cancelled, not us: take part in the next batch
                raise copy.copy(batch.error)
            assert batch.snap is not None
            return await _restore.copies(batch.snap, n)
        finally:
            with anyio.CancelScope(shield=True):
                await batch.leave()


async def _take(ws: WorkspaceCore, coord: Coordinator, batch: Batch) -> None:
    """Take ``batch``'s snapshot (the leader of a batch does this). Joiners are let in until the dump starts: one
    scheduling round first, so that calls started together share it, then while the previous dump runs."""
    try:
        await anyio.lowlevel.checkpoint()
        async with coord.lock:
            if coord.open is batch:
                coord.open = None
            batch.snap = await _snapshot(ws, None)
    except BaseException as exc:
        if coord.open is batch:
            coord.open = None
        batch.error = exc
        raise
    finally:
        batch.taken.set()


async def snapshot(ws: WorkspaceCore, backend: CriuBackend | None = None) -> Snapshot:
    """A snapshot of ``ws`` (see ``WorkspaceCore.snapshot``); snapshots, rollbacks and fork batches of one workspace
    run one at a time."""
    async with coordinator(ws).lock:
        return Snapshot(await _snapshot(ws, backend))


async def _snapshot(ws: WorkspaceCore, backend: CriuBackend | None) -> SnapshotRecord:
    """A snapshot, taken again once if CRIU could not freeze the tree (``_freeze_failed``): a process caught
    between fork and exec (a vfork parent waits, uninterruptibly, for a child CRIU has stopped) can make the freezer
    give up; a shell loop or a build hits it now and then, and the next attempt does not meet the same instant."""
    attempt = 0
    while True:
        try:
            return await _snapshot_once(ws, backend)
        except ForkError as exc:
            if attempt >= FREEZE_RETRIES or not _freeze_failed(exc):
                raise
        attempt += 1


def _freeze_failed(exc: ForkError) -> bool:
    """Whether a dump failed because CRIU could not freeze or seize the tree in time (its seize.c errors)."""
    return any(m in str(exc) for m in ("Unable to freeze cgroup", "Timeout reached. Try to interrupt"))


async def _snapshot_once(ws: WorkspaceCore, backend: CriuBackend | None) -> SnapshotRecord:
    if ws.state != "running" or ws.pid is None:
        raise ws.closed_error()
    backend = backend or _criu.default_backend()
    # Blocking steps are grouped into few worker-thread calls: each hop costs 0.1-0.5 ms here, and a snapshot
    # made ten of them before CRIU started.
    layer, fs = await anyio.to_thread.run_sync(lambda: (agent_layer(), fs_only()))
    assert ws.spec.image is not None
    snap = SnapshotRecord(
        workspace_id=ws.id,
        parent_lower=ws.lower or f"{layer}:{ws.spec.image.lower_dirs}",
        spec=ws.spec.detached(),
        mode="fs" if fs else "criu",
        setup=ws.setup,
    )
    gated: AgentClient | None = None
    requested = False  # the dump's request went to CRIU (the workspace drained)

    async def drained(held: Callable[[], None]) -> int | None:
        # CRIU has started already (``CriuBackend.call``'s ``ready``). The checks of ``_before_dump`` run while the
        # workspace's calls still go on, and again after the drain only if a call ran meanwhile (its processes may
        # change the net namespace or start a tracer at any time either way: CRIU fails on a traced task,
        # criu/patches/0008, and ``_undumpable`` names it then). The pause the calls see starts at ``held``.
        nonlocal gated, requested
        client = ws.client
        if client is None:
            raise ws.closed_error()
        mark = client.mark()
        blocked, netns = await anyio.to_thread.run_sync(_before_dump, ws)
        if not blocked:
            held()
            gated = await _quiesce.drain(ws)
            if not client.quiet_since(mark):
                blocked, netns = await anyio.to_thread.run_sync(_before_dump, ws)
        if blocked:
            raise ForkError(f"workspace {ws.id}: {blocked}", workspace_id=ws.id)
        requested = True
        return netns

    def resume() -> None:
        # CRIU answered: the tree is thawed (``leave_running``), so the workspace's calls go on while CRIU exits
        # and is reaped (0.2-4 ms here) and the snapshot's bookkeeping ends; ``finally`` resumes it anyway.
        if gated is not None:
            gated.resume()

    try:
        parent, track, env, rebase = await anyio.to_thread.run_sync(_open, ws, snap)
        if track and parent is None:
            parent = await precopy(ws, snap, backend)
        if snap.mode == "fs":
            gated = await _quiesce.drain(ws)
            await _fs_copy(ws, snap)
        else:
            try:
                if track:
                    env = {**env, "CRIU_WP_TRACK": "1"}
                if rebase:
                    # The dump ends the tree (``leave_running`` off), so the restore must follow it whatever
                    # happens; a cancellation takes effect after both (the drain is bounded, DRAIN_TIMEOUT).
                    with anyio.CancelScope(shield=True):
                        await _dump(ws, snap, backend, None, env, drained, rebase=True)
                        await _restore.rebase(ws, snap, backend)
                    await anyio.lowlevel.checkpoint()
                else:
                    await _dump(ws, snap, backend, parent, env, drained, track, thawed=resume)
            except ForkError as exc:
                if requested and (blocked := await anyio.to_thread.run_sync(_undumpable, ws, True)):
                    raise ForkError(f"workspace {ws.id}: {blocked}; {exc}", **exc.fields) from exc
                raise
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            if ws.cgroup is not None:  # a CRIU killed while the tree is frozen leaves it frozen
                ws.cgroup.thaw()
            await snap.aclose()
        if isinstance(exc, (ForkError, OSError)) and (full := store_full(exc, ws.id)) is not None:
            raise full from exc
        raise
    finally:
        if gated is not None:
            gated.resume()
    return snap


def _open(ws: WorkspaceCore, snap: SnapshotRecord) -> tuple[Path | None, bool, dict[str, str], bool]:
    """Make the snapshot's directory and take its references; the directory its dump is incremental on, if any
    (``_dump_parent``), whether the dump tracks writes (``_tracked_parent``), CRIU's environment (``dump_env``) and
    whether the dump re-bases ``ws`` (``_rebases``; blocking)."""
    with store_lock():  # the directory and its users at once for a collection in another process (``bunshin gc``)
        (snap.path if snap.mode == "fs" else snap.images).mkdir(parents=True)
        hold_layers([snap.path, *chain_layers(snap.lower)], snap.holder)
    if snap.mode == "fs":
        return None, False, {}, False
    parent = _dump_parent(ws, snap)
    if parent is not None or ws.mem_parent is not None or not tracking_wanted():
        ws.tracking.drop()  # a CoW copy's dumps are incremental on the memory it maps (criu/patches/0002)
        return parent, False, dump_env(), parent is None and _rebases(ws)
    return _tracked_parent(ws, snap), True, dump_env(), False


def _before_dump(ws: WorkspaceCore) -> tuple[str, int | None]:
    """What a CRIU dump of the drained ``ws`` needs to know first (blocking): why it cannot be dumped
    (``_undumpable``, ``""`` when it can) and the inode of its net namespace when that is left out of the images
    (``plain_netns``)."""
    blocked = _undumpable(ws, False)
    if blocked:
        return blocked, None
    assert ws.pid is not None
    # Under a user namespace a copy's fresh net namespace must be made by CRIU inside it (FRESH_NETNS); a CRIU
    # without that patch carries the net namespace instead (ip(8) and iptables-restore at every restore).
    netns = None
    if not ws.spec.security.userns or FRESH_NETNS in _criu.criu_features():
        netns = plain_netns(ws.pid)
    return "", netns


async def _dump(
    ws: WorkspaceCore,
    snap: SnapshotRecord,
    backend: CriuBackend,
    parent: Path | None,
    env: dict[str, str],
    drained: Callable[[Callable[[], None]], Awaitable[int | None]],
    track: bool = False,
    rebase: bool = False,
    thawed: Callable[[], None] | None = None,
) -> None:
    """CRIU dump of the workspace into ``snap.images``, the upper dir copied in the post-dump notification
    (``parent``: the snapshot directory the dump is incremental on, see ``_dump_parent``; ``env``: CRIU's;
    ``track``: CRIU tracks writes and hands us the uffds, ``WriteTracking``; ``rebase``: CRIU kills the tree once
    it is dumped, for ``_restore.rebase``, and leaves it running if the dump fails). ``drained`` drains the
    workspace once CRIU has started (so that CRIU's start is not part of the workspace's pause) and returns the net
    namespace to leave out of the images (``_before_dump``), calling the function it is given when it starts holding
    the workspace's calls; ``snap.dump_ms`` is counted from then to CRIU's answer, when ``thawed`` (not for a
    re-base, whose tree is gone) lets the workspace go on: the pause a call made meanwhile sees."""
    assert ws.pid is not None
    freezer = ws.cgroup.freezer_dir if ws.cgroup is not None else None
    req = rpc.criu_req(type=rpc.DUMP)
    _criu.base_opts(req)
    req.opts.pid = ws.pid
    # Killed while still frozen (cr-dump.c, cr_dump_finish: the final state is TASK_DEAD only on success), so
    # nothing runs between the dump and the restore that the restore would undo.
    req.opts.leave_running = not rebase
    # The workspace's net namespace has only loopback, so every TCP peer is in the frozen tree and no packet can
    # arrive while it is dumped: no lock is needed (and a lock left by a killed CRIU would cut the workspace's
    # loopback).
    req.opts.network_lock = rpc.SKIP
    req.opts.notify_scripts = True
    # Only the notifications handled below (query-ext-files is always sent): each is a round trip to this process,
    # and network-lock and network-unlock come with the tree frozen (criu/patches/0030).
    env = {**env, "CRIU_NOTIFY_ONLY": "post-dump"}
    # CRIU reads our (empty) answer to query-ext-files only before its next message (post-dump), not with the tree
    # frozen and waiting for this event loop (criu/patches/0032): ``on_notify`` must then not fail it, since CRIU
    # runs on, its parasite inside the tree, while we would answer and kill it; a failure waits for post-dump.
    env = {**env, "CRIU_EXT_FILES_LATER": "1"}
    # No build-id of each mapped ELF file (an open, an mmap and a walk of its notes per file, frozen; and again at
    # each restore, to compare): a copy's files are always the snapshot's own (its copy of the upper dir, taken
    # frozen, over the image's lower layers, which it holds), so the size CRIU checks suffices (criu/patches/0035).
    env = {**env, "CRIU_FILE_VALIDATION": "filesize"}
    req.opts.timeout = FREEZE_TIMEOUT
    if freezer is not None:
        req.opts.freeze_cgroup = str(freezer)
        if OVERLAP:
            # CRIU reads the tree's /proc/PID/smaps (a page-table walk) when it answers the ready check, while the
            # tree runs; frozen, it reads /proc/PID/maps and reuses what is unchanged (criu/patches/0015).
            env = {**env, "CRIU_SMAPS_EARLY": str(freezer)}
    if OVERLAP:
        # CRIU checks that the tree's namespaces belong to its user namespace (a fork of CRIU that setns()es into
        # each) when it answers the ready check, not frozen; the dump reuses that only for the same task in the
        # very same namespaces (criu/patches/0028).
        env = {**env, "CRIU_USERNS_EARLY": str(ws.pid)}
    if parent is not None:
        req.opts.parent_img = f"../../{parent.name}/images"  # relative to snap.images, as CRIU wants it
        if OVERLAP:
            # CRIU decodes the parent's pagemaps when it answers the ready check, not with the tree frozen
            # (criu/patches/0027); it uses them only if its parent link opens that very directory.
            env = {**env, "CRIU_PARENT_EARLY": str(parent / "images")}
    t0 = time.monotonic()

    def held() -> None:
        nonlocal t0
        t0 = time.monotonic()

    async def ready() -> None:
        netns = await drained(held)
        if netns is not None:
            req.opts.external.append(f"net[{netns}]:{NET_KEY}")
            snap.fresh_net = True

    def answered(resp: Any) -> None:
        # CRIU answers after the thaw (cr-dump.c, cr_dump_finish) and exits after that: its exit and reaping are
        # not the workspace's pause
        snap.dump_ms = (time.monotonic() - t0) * 1000
        if thawed is not None and posted:
            thawed()

    upper = _snapstore.TreeCopy(ws.dir / "upper", snap.upper, ws.id)
    last_pid = _pidns.LastPid(ws.pid, snap.images)  # for the copies' pids (criu/patches/0021)
    posted = False
    early_error: Exception | None = None

    async def on_notify(name: str, pid: int) -> None:
        # query-ext-files comes once the tree is frozen and seized (cr-dump.c, cr_dump_tasks: after collect_pstree
        # and network_lock, before any task is dumped): nothing in it can change the upper dir or make a process
        # until the thaw, so the upper dir's copy and the reading of its pid namespace's last pid run beside CRIU's
        # dump; post-dump, still frozen, waits for them.
        nonlocal posted, early_error
        if name == "query-ext-files":
            try:
                last_pid.ask()
                if OVERLAP:
                    upper.start()
            except Exception as exc:  # failed at post-dump, where CRIU waits for the answer (above)
                early_error = exc
        elif name == "post-dump":
            if early_error is not None:
                raise early_error
            snap.upper_bytes = await upper.finish()
            await last_pid.finish()
            posted = True

    uffds: list[int] = []
    refused = False  # a uffd past the bounds (``WriteTracking.room``) or no userfaultfd: the tracking is not kept

    def on_fd(name: str, pid: int, fd: int) -> None:
        # One uffd per task that had memory to arm: a workspace of many processes (up to Limits.pids) must not
        # fill this process's descriptor table in one dump, so the bound holds within a dump too.
        nonlocal refused
        if name == "wp-uffd" and track and not refused:
            if ws.tracking.room(len(uffds)) and _wptrack.is_uffd(fd):
                uffds.append(fd)
                return
            refused = True
        os.close(fd)

    adopted = False
    # CRIU's CPU is the run's: it dumps in a CPU-accounting cgroup under the run's parent (the restore's joins the
    # copy's cgroup), so a run's subtree counter (``accounting_scope``) includes every fork's dump. Made here without
    # an await (a mkdir), so that no cancellation comes between it, the descriptor and the finally that removes both.
    account, wrapper = cpu_account()
    fd = -1
    try:
        last_pid.start()  # its helper's exec before the freeze; it reads once asked (the finally lets it go)
        if OVERLAP:
            upper.prepare()  # its thread made before the freeze: query-ext-files only lets it go
        fd = os.open(snap.images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        req.opts.images_dir_fd = fd
        # Not cancelled midway: CRIU killed while its parasite runs inside a task of the tree leaves that task
        # executing the parasite without its tracer, and it dies (a cancelled snapshot killed the parent's pid 1,
        # and the workspace with it). A dump is bounded (FREEZE_TIMEOUT, DUMP_TIMEOUT) and short; a cancellation
        # takes effect when it ends, and the snapshot is then removed. The backend shields the call from the
        # request on (``ready``); until then (CRIU starting, the drain) a cancellation kills an idle CRIU.
        call = functools.partial(
            backend.call,
            req,
            work_dir=snap.images,
            log_name="dump.log",
            workspace_id=ws.id,
            notify=on_notify,
            env=env,
            wrapper=wrapper,
            timeout=DUMP_TIMEOUT,
            on_fd=on_fd,
            answered=answered,
        )
        if OVERLAP:
            await call(ready=ready)
        else:
            await ready()
            with anyio.CancelScope(shield=True):
                await call()
        if snap.dump_ms is None:  # a backend that does not report the answer as it comes
            snap.dump_ms = (time.monotonic() - t0) * 1000
        await anyio.lowlevel.checkpoint()  # a cancellation during the dump: the caller removes the snapshot
        if not posted:
            raise ForkError(f"workspace {ws.id}: CRIU never sent post-dump", workspace_id=ws.id)
        if track and not refused:
            ws.tracking.adopt(uffds, snap.path)
            adopted = True
    finally:
        await upper.join()  # a dump that failed after the freeze may have left its copy running
        await last_pid.join()
        if fd >= 0:
            os.close(fd)
        if track and not adopted:  # the dump may have consumed written sets this snapshot will not keep
            await _wptrack.close_fds(ws.tracking.take() + uffds)  # each close walks the task's mappings
        if account is not None:  # CRIU is reaped by now: the cgroup is empty (what it charged stays in the parent)
            with anyio.CancelScope(shield=True):
                await account.destroy()


async def _fs_copy(ws: WorkspaceCore, snap: SnapshotRecord) -> None:
    """A filesystem-only snapshot (no CRIU) of the drained workspace: freeze the cgroup so that no process writes
    while the upper dir is copied, note which recorded spawns still run, thaw."""
    assert ws.cgroup is not None
    t0 = time.monotonic()
    try:
        try:
            await ws.cgroup.freeze()
        except (OSError, TimeoutError) as exc:
            raise ForkError(f"workspace {ws.id}: cannot freeze its cgroup: {exc!r}", workspace_id=ws.id) from exc
        live = await anyio.to_thread.run_sync(_live_ns_pids, ws)
        snap.setup = [(step, pid) for step, pid in snap.setup if pid in live]
        snap.upper_bytes = await _snapstore.copy_tree(ws.dir / "upper", snap.upper, workspace_id=ws.id)
    finally:
        ws.cgroup.thaw()
    snap.frozen_ms = (time.monotonic() - t0) * 1000


def _undumpable(ws: WorkspaceCore, after_failure: bool) -> str:
    """Why CRIU cannot dump ``ws``'s tree, naming the processes by their in-workspace pid, or ``""`` (blocking).
    A task traced by another (a debugger, strace) cannot be seized and its ptrace state is not in the images;
    criu/patches/0008 fails the dump at once on one, this check fails it before CRIU starts. ``after_failure``
    also names tasks in uninterruptible sleep, which the freezer may be unable to freeze (a hung FUSE or NFS
    request): CRIU then gives up after ``FREEZE_TIMEOUT``."""
    pids = ws.cgroup.pids() if ws.cgroup is not None else []
    tasks = {pid: status for pid in pids if (status := task_status(pid)) is not None}

    def name(pid: int, fields: dict[str, str] | None) -> str:
        if fields is None:
            return f"host pid {pid} (outside the workspace)"
        return f"pid {(fields.get('NSpid', '').split() or [str(pid)])[-1]} ({fields.get('Name', '?')})"

    why: list[str] = []
    for pid, fields in tasks.items():
        tracer = int(fields.get("TracerPid", "0") or 0)
        if tracer:
            why.append(f"{name(pid, fields)} is traced by {name(tracer, tasks.get(tracer))}")
        elif after_failure and fields.get("State", "").startswith("D"):
            try:
                wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "?"
            except OSError:
                wchan = "?"
            why.append(f"{name(pid, fields)} is in uninterruptible sleep ({wchan}) and may not freeze")
    if not why:
        return ""
    remedy = "CRIU cannot dump a traced process: detach the tracer first" if "traced" in why[0] else "retry"
    return f"cannot snapshot: {'; '.join(why)} ({remedy})"


def _live_ns_pids(ws: WorkspaceCore) -> set[int]:
    """In-workspace pids of the workspace's processes that have not exited (blocking; call it frozen). A spawned
    process that exited is a zombie until the agent polls it; its innermost ``NSpid`` is its in-workspace pid."""
    statuses = [task_status(pid) for pid in (ws.cgroup.pids() if ws.cgroup is not None else [])]
    return {
        int(s["NSpid"].split()[-1])
        for s in statuses
        if s and s.get("NSpid") and not s.get("State", "").startswith(("Z", "X"))
    }


def _dump_parent(ws: WorkspaceCore, snap: SnapshotRecord) -> Path | None:
    """The snapshot directory whose images ``ws``'s memory is mapped from, when its dump can be incremental on
    them (criu/patches/0002: pages the copy never wrote are referenced, not written again): ``ws`` is a CoW copy
    and the chain is not too long. ``snap`` then holds that directory (blocking)."""
    parent = ws.mem_parent
    if ws.fork_mode != "criu-cow" or parent is None or not (parent / "images").is_dir():
        return None
    if mem_chain_depth(parent) >= MAX_MEM_CHAIN:
        return None  # a whole dump, which re-bases ``ws`` on it (``_rebases``)
    (snap.path / "parent").write_text(parent.name)
    hold_layers([parent], f"child-{snap.id}")
    return parent


def _rebases(ws: WorkspaceCore) -> bool:
    """Whether ``ws``'s next dump is whole because the image chain it maps is ``MAX_MEM_CHAIN`` deep, and ``ws`` is
    then restored from it in place (``_restore.rebase``; blocking). 0002 leaves a page to the parent only where the
    parent chain resolves it to the very image file and offset the copy maps, so a later dump can be incremental
    on no other snapshot than the one the copy maps: without the restore, every dump until the next rollback would
    be whole (a rolled-back workspace's chain grows by one per rollback to one of its own snapshots)."""
    parent = ws.mem_parent
    if ws.fork_mode != "criu-cow" or parent is None or not (parent / "images").is_dir():
        return False
    return mem_chain_depth(parent) >= MAX_MEM_CHAIN


def _tracked_parent(ws: WorkspaceCore, snap: SnapshotRecord) -> Path | None:
    """The snapshot whose dump last consumed ``ws``'s written pages, when the next dump can be incremental on
    it (``WriteTracking``): still there and the chain not too long; ``snap`` then holds it. Otherwise the
    tracking starts afresh and the dump is whole (blocking)."""
    tracking = ws.tracking
    parent = tracking.parent
    if parent is None or not (parent / "images").is_dir() or tracking.full():
        tracking.drop()
        return None
    if mem_chain_depth(parent) >= MAX_MEM_CHAIN:
        tracking.drop()
        return None
    (snap.path / "parent").write_text(parent.name)
    hold_layers([parent], f"child-{snap.id}")
    return parent


def plain_netns(pid: int) -> int | None:
    """The inode of ``pid``'s net namespace if it holds nothing but loopback with its default addresses and no
    route of its own (as a workspace starts), else ``None`` (blocking). Such a namespace is left out of the images
    and each copy gets a fresh one: CRIU would otherwise run ip(8) for its addresses, routes and rules (about 30 ms
    at the dump, 20 ms at each restore, and "Address already assigned" noise for loopback's own address). Sockets
    are per task and still carried. Loaded iptables tables count as configuration; nftables rules and sysctls set
    inside the workspace cannot be seen from /proc and are not carried by this path."""
    net = Path(f"/proc/{pid}/net")
    try:
        devs = [line.split(":", 1)[0].strip() for line in (net / "dev").read_text().splitlines()[2:]]
        inet6 = [line.split() for line in (net / "if_inet6").read_text().splitlines()]
        routes = (net / "route").read_text().splitlines()[1:]
        trie = (net / "fib_trie").read_text().splitlines()
        tables = [(net / name).read_text().strip() for name in ("ip_tables_names", "ip6_tables_names")]
        ino = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
    if any(tables):  # (legacy) iptables tables are loaded in it
        return None
    local = {trie[i - 1].split()[-1] for i, line in enumerate(trie) if line.strip() == "/32 host LOCAL"}
    if devs != ["lo"] or routes or local - {"127.0.0.1"}:
        return None
    if any(f[0] != "0" * 31 + "1" or f[-1] != "lo" for f in inet6):
        return None
    return ino
