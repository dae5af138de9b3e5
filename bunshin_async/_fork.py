"""Live fork, snapshot and rollback of running workspaces with CRIU.

A snapshot is a CRIU dump of the workspace's whole process tree (``leave_running``: the parent carries on) plus a
copy of its overlay upper dir taken in the ``post-dump`` notification, while the tree is still frozen, so memory and
files are one moment. Both live on tmpfs (``BUNSHIN_SNAPDIR``, default ``/dev/shm/bunshin-snap``; the set-up mounts
one with large folios there, ``prepare_snapshot_store``), so the freeze stays short; the first restore moves the
upper copy next to the workspaces, as a layer (below).

A fork is a restore of that snapshot into a new workspace: a new id, cgroup and directory, and a fresh, empty upper
dir over the snapshot's upper copy, stacked read-only as the top lower layer (copied once per snapshot, by its first
restore, to the workspaces' filesystem, so that files stat as in the parent; later restores copy nothing):
``lowerdir=<snapshot layer>:<the parent's lower chain>``, so a fork of a fork has a longer chain (``Workspace._lower``).
Layers live outside the snapshot dir (``<workspaces dir>/.layers/<snapshot id>``), because overlayfs forbids changing
a lower layer while an overlay on it is mounted and the snapshot dir goes as soon as the snapshot is closed: each
user (the snapshot, each workspace whose chain holds the layer) has a file in ``layers/<id>.users/`` (its owner
token, for ``bunshin gc``), and the last one to let go deletes the layer. A chain deeper than ``MAX_LAYERS`` is
not stacked further: the restore copies the top layer into the new upper instead (the old way), so depth stays
bounded (overlayfs allows 500 layers and a mount's options fit in a page).

CRIU recreates the tree's own mount, pid, net, ipc and uts namespaces
(they differ from CRIU's, so they are in the images); the overlay root is handed to it as ``root`` (as runc does),
mounted by a wrapper (``bunshin-init --restore-wrap``, ``_wrapper``) in a private mount namespace that exists only
for the restore, so no host mount is ever made. The wrapper first moves itself into the new cgroup; CRIU runs with
``manage_cgroups_mode=IGNORE``, so the restored tree simply inherits it. The workspace's /dev is a directory of the
agent layer, not a tmpfs, so CRIU has no tmpfs to archive (it tars each one at every dump and restore).

Who reaps the restored pid 1, and who kills it when the host dies: ``rst_sibling`` makes CRIU clone the root task
with ``CLONE_PARENT`` (cr-restore.c, ``maybe_clone_parent``), so the restored pid 1 is a child of this process, not
of CRIU. CRIU restores its ``PR_SET_PDEATHSIG(SIGKILL)`` (pie/restorer.c, ``restore_pdeath_sig``), so if the host
dies the kernel kills pid 1 and with it the whole pid namespace, as for a fresh workspace (where the shim is in
between). ``Workspace._teardown`` reaps it through its pidfd.

Memory of the copies (``ws.fork_mode``, chosen by ``BUNSHIN_FORK_MODE``, see ``restore_mode``):

- ``"criu-cow"`` (default when CRIU carries criu/patches/0001-cow-restore.patch): the restore runs with
  ``CRIU_COW_RESTORE=1``, so private anonymous memory is mapped ``MAP_PRIVATE`` from the snapshot's pages image on
  tmpfs instead of being read into fresh memory: all copies of one snapshot share every page until they write it.
  The image must never be modified while copies live. Each such copy holds its snapshot's directory
  (``ws._mem_parent``, reference-counted like the layers: ``<id>.users/``), so closing the snapshot keeps it while
  copies map it. Dumps run with ``CRIU_COW_ANON_PREFIX=<snapshot dir>/``, so such mappings are dumped as anonymous
  memory (forks of forks), and a dump of a CoW copy is incremental on the images it was restored from
  (criu/patches/0002, ``_dump_parent``): pages it never wrote are referenced, not written again, so a fork of a copy
  costs what the copy dirtied. The new snapshot holds that parent directory (its ``parent`` file names it) and lets
  go of it when it is deleted; a chain longer than ``MAX_MEM_CHAIN`` is cut by a full dump. Differences from plain
  anonymous memory are listed in criu/README.md.
- ``"criu"``: stock restore, every copy reads all its pages into private memory.
- ``"criu-ksm"`` (``BUNSHIN_FORK_MODE=ksm``): stock restore through a wrapper that sets ``PR_SET_MEMORY_MERGE`` (it is
  inherited across fork and exec) before exec'ing CRIU, so the restored tasks are mergeable; KSM is switched on
  (and tuned) while this process runs, and its previous settings are put back at exit. Merging is asynchronous.
- ``"fs"`` (``BUNSHIN_FORK_MODE=fs``, and ``auto`` when CRIU is unusable, see ``_criu.criu_unavailable``): a
  filesystem-only fork, not a live one. The snapshot (``snap.mode == "fs"``) freezes the workspace's cgroup, copies
  the upper dir and records which ``Workspace.spawn`` processes still run; no CRIU call is made. A copy is a cold
  start over the snapshot's layer chain that re-runs those spawns in their order (``ws.restarted_processes``, same
  argv, cwd, env and log file; started, not waited for: a server may not listen yet when the restore returns).
  Nothing in memory is carried: restarted processes start from scratch (in-workspace pids change), shell sessions,
  open connections and processes started any other way (``exec`` with ``&``, the children of a shell) are gone,
  and pid or lock files they left stay in the files. Any restore of an fs snapshot is an fs restore, and so is a
  restore of a CRIU snapshot while ``BUNSHIN_FORK_MODE=fs`` (its upper copy and record are the same).

Network: a workspace's net namespace that is as it started (``plain_netns``: loopback only, default addresses) is
left out of the images (``--external net[...]``) and each copy gets a fresh one, made by the restore wrapper and
handed to CRIU (``inherit_fd``); sockets are carried as always. Otherwise CRIU dumps and restores the namespace.

Policy for calls in flight: a snapshot waits for the workspace's running tool calls to finish (new ones wait for the
snapshot), because a connection from the host cannot be dumped; the agent's listening socket can, and is restored.
"""

from __future__ import annotations

import atexit
import copy
import errno
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from . import _gc, _kernel, _paths
from . import _protocol as P
from ._client import AgentClient
from ._criu import COW_RESTORE, CriuBackend, SwrkCriu, criu_features, criu_unavailable, rpc
from ._exceptions import BunshinError, CapabilityMissing, ForkError, StoreFull, WorkspaceClosed
from ._image import Image
from ._kernel import Cgroup, Limits
from ._security import Security

if TYPE_CHECKING:
    from ._spares import SparePool
    from ._workspace import Workspace

__all__ = ["ForkMode", "SetupStep", "Snapshot", "cow_available", "restore_mode", "snapshot_dir"]

ForkMode = str
"""How a workspace came to be: ``"fresh"`` (started cold), ``"criu"`` (restored from a CRIU snapshot, private
memory), ``"criu-cow"`` (restored sharing the snapshot's memory pages until written), ``"criu-ksm"`` (restored into
KSM-mergeable tasks), ``"fs"`` (files only: started cold over the snapshot's files, its recorded processes
restarted, no memory carried)."""


class SetupStep(msgspec.Struct, frozen=True):
    """One ``Workspace.spawn`` as it was sent to the agent (``env`` already merged with the workspace's), recorded
    so that a filesystem-only copy can start the process again."""

    argv: list[str] | None = None
    command: str | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    log_path: str | None = None
    user: str | None = None

    def request(self) -> P.Spawn:
        return P.Spawn(
            argv=self.argv, command=self.command, cwd=self.cwd, env=self.env, log_path=self.log_path, user=self.user
        )

    def __str__(self) -> str:
        return self.command if self.command is not None else shlex.join(self.argv or [])


DRAIN_TIMEOUT = 60.0
FREEZE_TIMEOUT = 10
"""Seconds CRIU may take to freeze and seize the tree (its ``timeout`` option): a process that cannot be frozen
fails the dump in this time, named (``_undumpable``)."""
DUMP_TIMEOUT = 120.0
RESTORE_TIMEOUT = 120.0
LOG_LEVEL = int(os.environ.get("BUNSHIN_CRIU_LOG_LEVEL", "2"))


def snapshot_dir() -> Path:
    """Where snapshots live; a tmpfs, so that images and the upper copy cost no disk I/O (see
    ``prepare_snapshot_store``)."""
    return Path(os.environ.get("BUNSHIN_SNAPDIR", "/dev/shm/bunshin-snap"))


STORE_OPTIONS = "huge=within_size,mode=0755"
"""The snapshot store's tmpfs: large folios for the page images. A first dump of a 200 MiB workspace writes its pages
~2x faster than into 4 KiB pages (fewer allocations and page-cache insertions), and CoW copies fault the image in
1 MiB-and-up folios (measured: mapping and reading 245 MiB 4.5 ms instead of 18 ms)."""


def snapshot_store() -> tuple[bool, str]:
    """Whether the snapshot directory is on a tmpfs with large folios (``huge=`` other than ``never``), and what it
    is on (blocking)."""
    found = _kernel.mount_options(snapshot_dir())
    if found is None:
        return False, f"{snapshot_dir()}: mount not found"
    fstype, options = found
    huge = next((o.split("=", 1)[1] for o in options.split(",") if o.startswith("huge=")), "never")
    ok = fstype == "tmpfs" and huge != "never"
    return ok, f"{snapshot_dir()} on {fstype} (huge={huge})"


def prepare_snapshot_store() -> str:
    """Mount a tmpfs with ``STORE_OPTIONS`` on the snapshot directory unless it is a mount point already (``bunshin
    snapstore``, run by the set-up; blocking). A directory that holds anything is left alone: mounting over it would
    hide live snapshots. Host configuration like a sysctl: the mount stays until reboot or ``umount``. Raises
    ``CapabilityMissing`` when it cannot mount."""
    base = snapshot_dir()
    base.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(base):
        return snapshot_store()[1]
    if any(base.iterdir()):
        raise CapabilityMissing(
            f"{base} holds snapshots: not mounting over them", capability="snapshot store", remedy="retry when idle"
        )
    from . import _native

    try:
        _native.mount("bunshin-snap", str(base), "tmpfs", 0, STORE_OPTIONS)
    except OSError as exc:
        raise CapabilityMissing(
            f"cannot mount a tmpfs on {base}: {exc.strerror}",
            capability="snapshot store",
            remedy="run as root, or point BUNSHIN_SNAPDIR at a tmpfs mounted with huge=within_size",
        ) from exc
    return snapshot_store()[1]


def layers_dir() -> Path:
    """Read-only overlay layers (snapshots' upper copies) and, beside each, ``<id>.users/`` (one file per user).
    On the workspaces' filesystem, not tmpfs: a file seen through a layer must stat as it did in the parent's
    upper dir (a directory's size and block count differ between tmpfs and a disk filesystem), and with every
    layer on one filesystem overlayfs keeps one st_dev for all files."""
    return _paths.workspaces_dir() / ".layers"


MAX_LAYERS = 40
"""Longest lower chain a restore stacks (the agent layer and image included); past it the top layer is copied."""

MAX_MEM_CHAIN = 8
"""Longest chain of incremental memory images (criu/patches/0002): a dump of a copy whose chain is this long
writes all its memory again, so restores open at most this many images (CRIU's limit is 16)."""

_layers_lock = threading.RLock()


def chain_layers(lower: str) -> list[Path]:
    """The snapshot layers in a lowerdir chain (not the agent layer or image, which are not reference-counted)."""
    base = layers_dir()
    return [Path(p) for p in lower.split(":") if Path(p).parent == base]


def _users(layer: Path) -> Path:
    return layer.with_name(layer.name + ".users")


def hold_layers(layers: list[Path], user: str) -> None:
    """Register ``user`` on each layer (blocking). The caller must already hold them through a live user."""
    token = _gc.owner_token(os.getpid())
    with _layers_lock:
        for layer in layers:
            users = _users(layer)
            users.mkdir(parents=True, exist_ok=True)
            path = users / user
            try:
                path.write_text(token)
            except OSError as exc:  # a full store: no empty reference may stay behind
                path.unlink(missing_ok=True)
                exc.filename = exc.filename or str(path)
                raise


def release_layers(layers: list[Path], user: str) -> None:
    """Drop ``user`` from each layer (or snapshot directory: the same reference counting) and delete those left
    with no user; a deleted snapshot directory lets go of the one its images are incremental on (blocking,
    idempotent)."""
    with _layers_lock:
        for layer in layers:
            users = _users(layer)
            (users / user).unlink(missing_ok=True)
            try:
                users.rmdir()
            except OSError:  # other users remain (or it is already gone)
                if users.exists():
                    continue
            parent = _mem_parent_of(layer)
            shutil.rmtree(layer, ignore_errors=True)
            if parent is not None:
                release_layers([parent], f"child-{layer.name}")
        try:
            layers_dir().rmdir()
        except OSError:
            pass


def _mem_parent_of(snap_dir: Path) -> Path | None:
    """The snapshot directory whose images ``snap_dir``'s images are incremental on (its ``parent`` file)."""
    try:
        return snap_dir.with_name((snap_dir / "parent").read_text().strip())
    except OSError:
        return None


def mem_chain_depth(snap_dir: Path) -> int:
    """How many images an incremental image chain starting at ``snap_dir`` holds (blocking)."""
    depth = 0
    cur: Path | None = snap_dir
    while cur is not None and depth <= MAX_MEM_CHAIN:
        depth += 1
        cur = _mem_parent_of(cur)
    return depth


def collect_layers() -> list[str]:
    """``bunshin gc``: delete the layers and snapshot directories whose users are all dead processes (blocking)."""
    return _collect(layers_dir(), "layer") + _collect(snapshot_dir(), "snapshot")


def _collect(base: Path, what: str) -> list[str]:
    out: list[str] = []
    with _layers_lock:
        for entry in sorted(base.iterdir()) if base.exists() else []:
            if entry.name.endswith(".users"):
                continue
            users = _users(entry.with_name(entry.name.removesuffix(".partial")))  # a layer being made
            tokens = [u.read_text().strip() for u in users.iterdir()] if users.is_dir() else []
            alive = [t for t in tokens if _gc.alive(t)]
            if alive:
                out.append(f"kept {what} {entry.name} ({len(alive)} live users)")
                continue
            shutil.rmtree(users, ignore_errors=True)
            shutil.rmtree(entry, ignore_errors=True)
            out.append(f"removed {what} {entry.name}")
        for users in sorted(base.glob("*.users")) if base.exists() else []:
            if not users.with_name(users.name[: -len(".users")]).exists():
                shutil.rmtree(users, ignore_errors=True)
        try:
            base.rmdir()
        except OSError:
            pass
    return out


def default_backend() -> CriuBackend:
    return SwrkCriu()


# ---------------------------------------------------------------------------------------------------- memory modes


def cow_available() -> bool:
    """Whether the CRIU in use carries the CoW-restore patch (``criu --version`` lists ``Features: cow-restore``)."""
    return COW_RESTORE in criu_features()


KSM_DIR = Path("/sys/kernel/mm/ksm")
KSM_TUNING = {"run": "1", "pages_to_scan": "2000", "sleep_millisecs": "10"}
"""What ``criu-ksm`` mode writes to /sys/kernel/mm/ksm: about 200k pages (800 MiB) scanned per second."""


def restore_mode() -> ForkMode:
    """The ``fork_mode`` the next restore gets, from ``BUNSHIN_FORK_MODE``: ``auto`` (default: ``criu-cow`` when
    the patched CRIU is present, else ``criu``, and ``fs`` when CRIU is unusable), ``cow``, ``criu`` (alias
    ``stock``), ``ksm`` or ``fs``. A mode the host cannot provide raises ``CapabilityMissing``; nothing falls back
    silently except ``auto``, and its ``fs`` shows in ``ws.fork_mode`` and ``bunshin doctor``."""
    want = _wanted_mode()
    if want == "auto":
        if criu_unavailable() is not None:
            return "fs"
        return "criu-cow" if cow_available() else "criu"
    if want == "fs":
        return "fs"
    if want in ("cow", "criu-cow"):
        if not cow_available():
            raise CapabilityMissing(
                "BUNSHIN_FORK_MODE=cow but CRIU lacks the cow-restore patch",
                capability="criu-cow",
                remedy="list 0001-cow-restore.patch in criu/patches/series and run `criu/build.sh`",
            )
        return "criu-cow"
    if want in ("criu", "stock"):
        return "criu"
    if want in ("ksm", "criu-ksm"):
        if not (KSM_DIR / "run").exists():
            raise CapabilityMissing(
                "BUNSHIN_FORK_MODE=ksm but the kernel has no KSM", capability="ksm", remedy="CONFIG_KSM=y"
            )
        return "criu-ksm"
    raise ValueError(f"BUNSHIN_FORK_MODE={want!r}: expected auto, cow, criu, ksm or fs")


def _wanted_mode() -> str:
    return os.environ.get("BUNSHIN_FORK_MODE", "auto").strip().lower() or "auto"


def fs_only() -> bool:
    """Whether a snapshot taken now is filesystem-only (``BUNSHIN_FORK_MODE=fs``, or ``auto`` with CRIU unusable).
    Unlike ``restore_mode`` it never raises: the CRIU modes are a restore's choice, made per restore."""
    want = _wanted_mode()
    return want == "fs" or (want == "auto" and criu_unavailable() is not None)


def _cow_prefix() -> str:
    return f"{snapshot_dir()}/"


_KSM_SHIM = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.prctl(67, 1, 0, 0, 0):  # PR_SET_MEMORY_MERGE\n"
    "    sys.exit('PR_SET_MEMORY_MERGE: ' + os.strerror(ctypes.get_errno()))\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)

_ksm_lock = threading.Lock()
_ksm_saved: dict[str, str] | None = None


def _ksm_enable() -> None:
    """Switch KSM on with ``KSM_TUNING`` once per process; ``ksm_restore`` (run at exit) puts the old values back."""
    global _ksm_saved
    with _ksm_lock:
        if _ksm_saved is not None:
            return
        saved: dict[str, str] = {}
        try:
            for name, value in KSM_TUNING.items():
                path = KSM_DIR / name
                saved[name] = path.read_text().strip()
                if saved[name] != value:
                    path.write_text(value)
        except OSError as exc:
            _write_ksm(saved)
            raise CapabilityMissing(
                f"cannot switch KSM on: {exc}", capability="ksm", remedy="run as root with CONFIG_KSM=y"
            ) from exc
        _ksm_saved = saved
        atexit.register(ksm_restore)


def _write_ksm(values: dict[str, str]) -> None:
    for name in reversed(list(values)):  # run last in, first out
        try:
            (KSM_DIR / name).write_text(values[name])
        except OSError:
            pass


def ksm_restore() -> None:
    """Put back the KSM settings ``criu-ksm`` mode changed (idempotent)."""
    global _ksm_saved
    with _ksm_lock:
        if _ksm_saved is not None:
            _write_ksm(_ksm_saved)
            _ksm_saved = None


def _mode_wrapper(mode: ForkMode) -> tuple[dict[str, str], list[str]]:
    """The environment and command prefix (it ends by exec'ing the rest) that give a restore's CRIU its memory
    mode."""
    if mode == "criu-cow":
        return {"CRIU_COW_RESTORE": "1", "CRIU_COW_ANON_PREFIX": _cow_prefix()}, []
    if mode == "criu-ksm":
        return {}, [sys.executable, "-I", "-S", "-c", _KSM_SHIM]
    return {}, []


def _dump_env() -> dict[str, str]:
    """Dumps always recognise CoW-restored memory when CRIU can (the workspace may be such a copy)."""
    return {"CRIU_COW_ANON_PREFIX": _cow_prefix()} if cow_available() else {}


class Snapshot:
    """A frozen moment of a workspace: CRIU images and the upper dir (a layer, see the module doc); for ``mode ==
    "fs"`` only the upper dir and the recorded setup (``setup``), no images. Owns its
    directory; ``aclose()`` removes it and lets go of its layers (idempotent). Workspaces restored from it do not
    need it afterwards. ``lower`` is the full lowerdir chain a copy mounts under its empty upper."""

    def __init__(
        self,
        *,
        workspace_id: str,
        parent_lower: str,
        image: Image,
        limits: Limits,
        workdir: str,
        env: dict[str, str],
        hostname: str,
        max_output: int,
        user: str | None = None,
        security: Security,
        mode: str = "criu",
        setup: list[tuple[SetupStep, int]] | None = None,
    ) -> None:
        self.id = secrets.token_hex(6)
        self.workspace_id = workspace_id
        self.mode = mode
        """``"criu"`` (CRIU images: a live fork) or ``"fs"`` (files and ``setup`` only, see the module doc)."""
        self.setup = list(setup or [])
        """The workspace's recorded spawns with their in-workspace pids (for ``"fs"``: those still running)."""
        self.path = snapshot_dir() / self.id
        self.parent_lower = parent_lower
        self.lower = f"{self.layer}:{parent_lower}"
        self._layer_lock = anyio.Lock()
        self.image = image
        self.limits = limits
        self.workdir = workdir
        self.env = env
        self.hostname = hostname
        self.max_output = max_output
        self.user = user
        self.security = security
        self.dump_ms: float | None = None
        self.frozen_ms: float | None = None
        self.fresh_net = False
        """The net namespace was left out of the images (``plain_netns``): each copy gets a fresh loopback-only one."""
        self._closed = False
        self._spares: SparePool | None = None

    @property
    def images(self) -> Path:
        return self.path / "images"

    @property
    def upper(self) -> Path:
        """The upper dir as copied at the dump (on tmpfs: short freeze); the first restore turns it into ``layer``."""
        return self.path / "upper"

    @property
    def layer(self) -> Path:
        """The upper copy as a read-only overlay layer on the workspaces' filesystem (made by the first restore)."""
        return layers_dir() / self.id

    async def _materialize(self) -> None:
        """Move the tmpfs upper copy to ``layer`` once (a copy: another filesystem), then free the tmpfs copy."""
        async with self._layer_lock:
            if self.layer.is_dir():
                return
            if self.closed:
                raise ForkError(f"snapshot {self.id} is closed", workspace_id=self.workspace_id)
            partial = self.layer.with_name(f"{self.id}.partial")
            try:
                partial.parent.mkdir(parents=True, exist_ok=True)
                await _copy_tree(self.upper, partial, workspace_id=self.workspace_id)
                partial.rename(self.layer)
            finally:
                with anyio.CancelScope(shield=True):
                    if partial.exists():
                        await anyio.to_thread.run_sync(shutil.rmtree, partial, True)
            await anyio.to_thread.run_sync(shutil.rmtree, self.upper, True)

    @property
    def closed(self) -> bool:
        return self._closed

    def keep_spares(self, k: int) -> SparePool:
        """A pool keeping ``k`` frozen, pre-restored copies for ``Workspace.from_snapshot`` to hand out in
        milliseconds (``async with snap.keep_spares(k):``; see ``bunshin_async._spares``)."""
        from ._spares import SparePool

        return SparePool(self, k)

    async def aclose(self) -> None:
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._spares is not None:
                await self._spares.aclose()
            await anyio.to_thread.run_sync(shutil.rmtree, self.upper, True)
            # The directory itself goes with its last user: CoW copies map its pages image and incremental
            # images of their own memory refer to it (``release_layers``).
            await anyio.to_thread.run_sync(release_layers, [self.path, *chain_layers(self.lower)], self._user)

    @property
    def _user(self) -> str:
        return f"snapshot-{self.id}"

    async def __aenter__(self) -> Snapshot:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} of {self.workspace_id}>"

    @classmethod
    def adopt(cls, snap_id: str, *, lower: str, fresh_net: bool = False, **record: Any) -> Snapshot:
        """A ``Snapshot`` object for a directory ``snap_id`` already in the store whose layers are in place (an
        imported one, ``bunshin_async._transfer``); the caller holds its references (``hold_layers``). ``lower``
        is its full chain, its own layer first; ``record`` the keyword arguments of ``__init__`` but the chain."""
        own, _, parent_lower = lower.partition(":")
        snap = cls(parent_lower=parent_lower, **record)
        snap.id = snap_id
        snap.path = snapshot_dir() / snap_id
        snap.lower = lower
        snap.fresh_net = fresh_net
        if own != str(snap.layer):
            raise ValueError(f"lower chain {lower!r} does not start with the layer of {snap_id}")
        return snap


# ---------------------------------------------------------------------------------------------------- quiescing


class GatedAgentClient(AgentClient):
    """An ``AgentClient`` that can be paused: ``quiesce()`` lets calls in flight finish, holds new ones and closes
    every idle connection, so that the agent holds no connection to the host while CRIU dumps it."""

    def __init__(self, socket_path: str, workspace_id: str) -> None:
        super().__init__(socket_path, workspace_id)
        self._open = anyio.Event()
        self._open.set()
        self._in_flight = 0
        self._drained = anyio.Event()

    async def request(self, req: P.Request) -> P.Response:
        while not self._open.is_set():
            await self._open.wait()
        self._in_flight += 1
        try:
            return await super().request(req)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    async def quiesce(self) -> None:
        self._open = anyio.Event()
        while self._in_flight:
            self._drained = anyio.Event()
            await self._drained.wait()
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    def resume(self) -> None:
        self._open.set()


async def _gated(ws: Workspace) -> GatedAgentClient:
    client = ws._client
    if isinstance(client, GatedAgentClient):
        return client
    if client is None:
        raise WorkspaceClosed(f"workspace {ws.id} is {ws._state}", workspace_id=ws.id)
    gated = GatedAgentClient(client.socket_path, ws.id)
    ws._client = gated
    # Calls in flight on the old client close their connection when they end instead of pooling it.
    client._closed = True
    idle, client._idle = client._idle, []
    for conn in idle:
        await conn.aclose()
    return gated


def _host_connections(ws: Workspace) -> int:
    """Sockets held by the workspace's processes that live in the host's net namespace: the agent's ends of host
    connections (an accepted Unix socket takes its net namespace from the connecting side, af_unix.c
    ``unix_stream_connect``), which CRIU cannot dump."""
    if ws.cgroup is None:
        return 0
    held: set[str] = set()
    for pid in ws.cgroup.pids():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    held.add(link[8:-1])
        except OSError:
            continue
    if not held:
        return 0
    with open("/proc/self/net/unix") as f:
        next(f)
        return sum(1 for line in f if line.split()[6] in held)


async def _drain(ws: Workspace) -> GatedAgentClient:
    """Hold new calls and wait out those in flight. On any failure, cancellation included, the gate reopens."""
    gated = await _gated(ws)
    try:
        with anyio.move_on_after(DRAIN_TIMEOUT) as scope:
            await gated.quiesce()
            delay = 0.0005
            while _host_connections(ws):  # the agent closes its end once it reads our hang-up
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.02)
    except BaseException:
        gated.resume()
        raise
    if scope.cancelled_caught:
        gated.resume()
        raise ForkError(f"workspace {ws.id}: tool calls did not finish within {DRAIN_TIMEOUT} s", workspace_id=ws.id)
    return gated


# ---------------------------------------------------------------------------------------------------- dump


def _base_opts(req: Any) -> None:
    req.opts.log_level = LOG_LEVEL
    req.opts.tcp_established = True
    req.opts.file_locks = True
    req.opts.manage_cgroups = True
    req.opts.manage_cgroups_mode = rpc.IGNORE


async def _copy_tree(src: Path, dst: Path, *, workspace_id: str = "") -> None:
    """A failed copy is a ``ForkError``: a snapshot or copy with missing files must never be used."""
    # cp keeps overlay's trusted.* xattrs (whiteouts, opaque dirs, origin), which shutil.copytree does not.
    try:
        await anyio.run_process(["cp", "-a", "--reflink=auto", "--", str(src), str(dst)])
    except (OSError, subprocess.CalledProcessError) as exc:
        why = getattr(exc, "stderr", None) or str(exc)
        why = why.decode(errors="replace") if isinstance(why, bytes) else why
        raise ForkError(f"copying {src} to {dst} failed: {why.strip()}", workspace_id=workspace_id) from exc


class _Batch:
    """Concurrent ``fork`` calls on one workspace that share one snapshot (``snap``, or the ``error`` its taking
    raised, once ``taken`` is set); each caller restores its own copies from it, and the last one to finish
    closes it."""

    def __init__(self) -> None:
        self.users = 0
        self.taken = anyio.Event()
        self.snap: Snapshot | None = None
        self.error: BaseException | None = None

    async def leave(self) -> None:
        self.users -= 1
        if self.users == 0 and self.snap is not None:
            with anyio.CancelScope(shield=True):
                await self.snap.aclose()


class _Coordinator:
    """Per workspace: one snapshot or rollback at a time (CRIU seizes the whole tree, and two dumps of one tree
    collide in ``PTRACE_SEIZE``), and the fork batch still open to joiners."""

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.open: _Batch | None = None


_coordinators: weakref.WeakKeyDictionary[Workspace, _Coordinator] = weakref.WeakKeyDictionary()


def _coordinator(ws: Workspace) -> _Coordinator:
    coord = _coordinators.get(ws)
    if coord is None:
        coord = _coordinators[ws] = _Coordinator()
    return coord


async def fork(ws: Workspace, n: int) -> list[Workspace]:
    """``n`` copies of ``ws`` as it is now. Concurrent calls on one workspace are coalesced: those that arrive
    while no dump of it has started share the next one (16 concurrent ``fork(1)`` take one dump, or two when the
    first had started already), and each restores its own copies from it, so one caller's failed or cancelled
    restore does not touch the others. A call that joined a batch whose taker was cancelled joins the next one."""
    if n < 1:
        raise ValueError("n must be at least 1")
    coord = _coordinator(ws)
    while True:
        batch = coord.open
        lead = batch is None
        if batch is None:
            batch = coord.open = _Batch()
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
            return await type(ws).from_snapshot(batch.snap, n)
        finally:
            with anyio.CancelScope(shield=True):
                await batch.leave()


async def _take(ws: Workspace, coord: _Coordinator, batch: _Batch) -> None:
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


async def snapshot(ws: Workspace, backend: CriuBackend | None = None) -> Snapshot:
    """A snapshot of ``ws`` (see ``Workspace.snapshot``); snapshots, rollbacks and fork batches of one workspace
    run one at a time."""
    async with _coordinator(ws).lock:
        return await _snapshot(ws, backend)


async def _snapshot(ws: Workspace, backend: CriuBackend | None) -> Snapshot:
    from ._image import agent_layer

    if ws._state != "running" or ws.pid is None:
        raise WorkspaceClosed(f"workspace {ws.id} is {ws._state}", workspace_id=ws.id)
    backend = backend or default_backend()
    layer = await anyio.to_thread.run_sync(agent_layer)
    snap = Snapshot(
        workspace_id=ws.id,
        parent_lower=ws._lower or f"{layer}:{ws.image.lower_dirs}",
        image=ws.image,
        limits=ws.limits,
        workdir=ws.workdir,
        env=dict(ws.env),
        hostname=ws.hostname,
        max_output=ws.max_output,
        user=ws.user,
        security=ws.security,
        mode="fs" if await anyio.to_thread.run_sync(fs_only) else "criu",
        setup=ws._setup,
    )
    gated: GatedAgentClient | None = None
    try:
        (snap.path if snap.mode == "fs" else snap.images).mkdir(parents=True)
        await anyio.to_thread.run_sync(hold_layers, [snap.path, *chain_layers(snap.lower)], snap._user)
        parent = None if snap.mode == "fs" else await anyio.to_thread.run_sync(_dump_parent, ws, snap)
        gated = await _drain(ws)
        if snap.mode == "fs":
            await _fs_copy(ws, snap)
        else:
            if blocked := await anyio.to_thread.run_sync(_undumpable, ws, False):
                raise ForkError(f"workspace {ws.id}: {blocked}", workspace_id=ws.id)
            try:
                await _dump(ws, snap, backend, parent)
            except ForkError as exc:
                if blocked := await anyio.to_thread.run_sync(_undumpable, ws, True):
                    raise ForkError(f"workspace {ws.id}: {blocked}; {exc}", **exc._kwargs) from exc
                raise
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            _thaw(ws)
            await snap.aclose()
        if isinstance(exc, (ForkError, OSError)) and (full := _store_full(exc, ws.id)) is not None:
            raise full from exc
        raise
    finally:
        if gated is not None:
            gated.resume()
    return snap


def _store_full(exc: BaseException, workspace_id: str, *, dump: bool = True) -> StoreFull | None:
    """``StoreFull`` when ``exc`` came from the snapshot store running out of space. A dump (``dump``) writes
    nothing but the store, so any ENOSPC of it counts (CRIU's and cp's "No space left on device" too); a restore
    writes only its reference files there, so only an ``OSError`` on a path in the store counts (a full disk under
    the workspaces is not the store). Checked after the failed snapshot's directory is gone: ``free_bytes`` is what
    remains without it."""
    store = snapshot_dir()
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        if not dump and not str(exc.filename or "").startswith(f"{store}/"):
            return None
    elif not dump or os.strerror(errno.ENOSPC) not in str(exc):
        return None
    try:
        st = os.statvfs(store)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return StoreFull(
        f"workspace {workspace_id}: the snapshot store {store} is full ({free >> 20} MiB free): close snapshots "
        "or copies mapping them, or run `bunshin gc`, then retry",
        workspace_id=workspace_id,
        store=str(store),
        free_bytes=free,
    )


async def _dump(ws: Workspace, snap: Snapshot, backend: CriuBackend, parent: Path | None) -> None:
    """CRIU dump of the drained workspace into ``snap.images``, the upper dir copied in the post-dump notification
    (``parent``: the snapshot directory the dump is incremental on, see ``_dump_parent``)."""
    assert ws.pid is not None
    freezer = ws.cgroup.freezer_dir if ws.cgroup is not None else None
    req = rpc.criu_req(type=rpc.DUMP)
    _base_opts(req)
    req.opts.pid = ws.pid
    req.opts.leave_running = True
    # The workspace's net namespace has only loopback, so every TCP peer is in the frozen tree and no packet can
    # arrive while it is dumped: no lock is needed (and a lock left by a killed CRIU would cut the workspace's
    # loopback).
    req.opts.network_lock = rpc.SKIP
    req.opts.notify_scripts = True
    req.opts.timeout = FREEZE_TIMEOUT
    if freezer is not None:
        req.opts.freeze_cgroup = str(freezer)
    if parent is not None:
        req.opts.parent_img = f"../../{parent.name}/images"  # relative to snap.images, as CRIU wants it
    netns = await anyio.to_thread.run_sync(plain_netns, ws.pid)
    if netns is not None:
        req.opts.external.append(f"net[{netns}]:{NET_KEY}")
        snap.fresh_net = True

    async def on_notify(name: str, pid: int) -> None:
        if name == "post-dump":
            await _copy_tree(ws.directory / "upper", snap.upper, workspace_id=ws.id)

    fd = os.open(snap.images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        req.opts.images_dir_fd = fd
        env = await anyio.to_thread.run_sync(_dump_env)
        t0 = time.monotonic()
        # Not cancelled midway: CRIU killed while its parasite runs inside a task of the tree leaves that task
        # executing the parasite without its tracer, and it dies (a cancelled snapshot killed the parent's pid 1,
        # and the workspace with it). A dump is bounded (FREEZE_TIMEOUT, DUMP_TIMEOUT) and short; a cancellation
        # takes effect when it ends, and the snapshot is then removed.
        with anyio.CancelScope(shield=True):
            await backend.call(
                req,
                work_dir=snap.images,
                log_name="dump.log",
                workspace_id=ws.id,
                notify=on_notify,
                env=env,
                timeout=DUMP_TIMEOUT,
            )
        snap.dump_ms = (time.monotonic() - t0) * 1000
    finally:
        os.close(fd)
    await anyio.lowlevel.checkpoint()  # a cancellation that came during the dump: the caller removes the snapshot
    if not snap.upper.is_dir():
        raise ForkError(f"workspace {ws.id}: CRIU never sent post-dump", workspace_id=ws.id)


async def _fs_copy(ws: Workspace, snap: Snapshot) -> None:
    """A filesystem-only snapshot (no CRIU) of the drained workspace: freeze the cgroup so that no process writes
    while the upper dir is copied, note which recorded spawns still run, thaw."""
    from ._spares import freeze

    t0 = time.monotonic()
    try:
        try:
            await freeze(ws)
        except (OSError, TimeoutError) as exc:
            raise ForkError(f"workspace {ws.id}: cannot freeze its cgroup: {exc!r}", workspace_id=ws.id) from exc
        live = await anyio.to_thread.run_sync(_live_ns_pids, ws)
        snap.setup = [(step, pid) for step, pid in snap.setup if pid in live]
        await _copy_tree(ws.directory / "upper", snap.upper, workspace_id=ws.id)
    finally:
        _thaw(ws)
    snap.frozen_ms = (time.monotonic() - t0) * 1000


def _undumpable(ws: Workspace, after_failure: bool) -> str:
    """Why CRIU cannot dump ``ws``'s tree, naming the processes by their in-workspace pid, or ``""`` (blocking).
    A task traced by another (a debugger, strace) cannot be seized and its ptrace state is not in the images;
    criu/patches/0008 fails the dump at once on one, this check fails it before CRIU starts. ``after_failure``
    also names tasks in uninterruptible sleep, which the freezer may be unable to freeze (a hung FUSE or NFS
    request): CRIU then gives up after ``FREEZE_TIMEOUT``."""
    tasks: dict[int, dict[str, str]] = {}
    for pid in ws.cgroup.pids() if ws.cgroup is not None else []:
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        tasks[pid] = {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}

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


def _live_ns_pids(ws: Workspace) -> set[int]:
    """In-workspace pids of the workspace's processes that have not exited (blocking; call it frozen). A spawned
    process that exited is a zombie until the agent polls it; ``NSpid`` in /proc/<pid>/status lists a task's pid in
    each pid namespace it is in, innermost last (proc(5))."""
    live: set[int] = set()
    for pid in ws.cgroup.pids() if ws.cgroup is not None else []:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        nspid = fields.get("NSpid", "").split()
        if nspid and not fields.get("State", "").strip().startswith(("Z", "X")):
            live.add(int(nspid[-1]))
    return live


def _dump_parent(ws: Workspace, snap: Snapshot) -> Path | None:
    """The snapshot directory whose images ``ws``'s memory is mapped from, when its dump can be incremental on
    them (criu/patches/0002: pages the copy never wrote are referenced, not written again): ``ws`` is a CoW copy
    and the chain is not too long. ``snap`` then holds that directory (blocking)."""
    parent = ws._mem_parent
    if ws.fork_mode != "criu-cow" or parent is None or not (parent / "images").is_dir():
        return None
    if mem_chain_depth(parent) >= MAX_MEM_CHAIN:
        return None
    (snap.path / "parent").write_text(parent.name)
    hold_layers([parent], f"child-{snap.id}")
    return parent


def _thaw(ws: Workspace) -> None:
    """A CRIU killed while the tree is frozen leaves the freezer cgroup FROZEN (ptrace lets go by itself)."""
    freezer = ws.cgroup.freezer_dir if ws.cgroup is not None else None
    if freezer is None:
        return
    state = freezer / ("freezer.state" if ws.cgroup is not None and ws.cgroup.version == 1 else "cgroup.freeze")
    try:
        state.write_text("THAWED" if state.name == "freezer.state" else "0")
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------------- restore


NET_KEY = "bunshin-net"
NET_FD = 9
"""``--external net[ino]:NET_KEY`` at the dump; at the restore CRIU inherits the fresh namespace on fd ``NET_FD``."""


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


def _wrapper(cgroup: Cgroup, lower: str, upper: Path, work: Path, root: Path, fresh_net: bool = False) -> list[str]:
    """``bunshin-init --restore-wrap`` (native/init.c) gives the restore a private mount namespace (no host mount,
    nothing to clean up if we die), joins the cgroup and mounts the root overlay there, then execs CRIU (same pid:
    still our child). With ``fresh_net`` it also makes a new net namespace, brings its loopback up and hands it to
    CRIU on ``NET_FD``."""
    opts = f"lowerdir={lower},upperdir={upper},workdir={work},index=on,nfs_export=on"
    joins = [arg for p in cgroup.procs_files for arg in ("--cgroup", str(p))]
    net = ["--net"] if fresh_net else []
    return [str(_paths.init_binary()), "--restore-wrap", *net, *joins, "--overlay", opts, "--root", str(root), "--"]


def _strays(cgroup: Cgroup) -> list[int]:
    """Kill what a failed restore left in the cgroup; return those that are our children in another pid namespace
    (a restored root task, through rst_sibling). CRIU itself is in the cgroup too (the restore wrapper joined it)
    and our child, but the CRIU backend reaps it: reaping it here made asyncio's child watcher report a lost
    child."""
    me, ours = os.getpid(), []
    for pid in cgroup.pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            nspids = next(
                (
                    line.split()[1:]
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("NSpid:")
                ),
                [],
            )
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and len(nspids) > 1:
            ours.append(pid)
    return ours


def _dead_restored_children() -> list[int]:
    """Our zombie children in another pid namespace: a restored root task (our child through rst_sibling) that
    died with a failed restore has left its cgroup already, so ``_strays`` cannot see it (blocking)."""
    me, out = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines() if ":" in line
            )
        except OSError:
            continue
        if status.get("PPid", "").strip() == me and status.get("State", "").strip().startswith("Z"):
            if len(status.get("NSpid", "").split()) > 1:
                out.append(int(entry))
    return out


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


async def restore_into(ws: Workspace, snap: Snapshot, backend: CriuBackend | None = None) -> None:
    """Make ``ws`` (state "new", no directory yet) a live copy of ``snap`` (a filesystem-only one for an fs snapshot
    or mode). On failure everything made for it is removed and the error (``ForkError`` for CRIU failures and failed
    restarts) raised."""
    if snap.closed:
        raise ForkError(f"snapshot {snap.id} is closed", workspace_id=ws.id)
    ws._state = "starting"
    try:
        _prime_attach()
        ws._make_dirs(upper=False)
        await _upper_from(ws, snap)
        ws._cgroup = Cgroup.create(f"ws-{ws.id}", ws.limits, ws.security.device_rules())
        await _restore(ws, snap, backend or default_backend())
        ws._state = "running"
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await ws._teardown()
        ws._state = "closed"
        if isinstance(exc, OSError) and (full := _store_full(exc, ws.id, dump=False)) is not None:
            raise full from exc
        raise


def _prime_attach() -> None:
    """Let ``_kernel.prime_cgroup_attach`` run while the restore is prepared, so that the restore wrapper's cgroup
    attach need not wait a grace period (~6 ms a restore here). A daemon thread, not a task: it has no result, ends
    by itself within one grace period and must not turn the restore's errors into exception groups."""
    threading.Thread(target=_kernel.prime_cgroup_attach, name="bunshin-prime-attach", daemon=True).start()


async def rollback(ws: Workspace, snap: Snapshot, backend: CriuBackend | None = None) -> None:
    """Replace the processes and files of ``ws`` by the snapshot's; ``ws`` keeps its id, directory and cgroup. If
    the restore fails the workspace is closed (its old state is already gone) and ``ForkError`` raised. Waits for
    a snapshot of ``ws`` in progress (and the other way round)."""
    async with _coordinator(ws).lock:
        await _rollback(ws, snap, backend)


async def _rollback(ws: Workspace, snap: Snapshot, backend: CriuBackend | None) -> None:
    if ws._state != "running":
        raise WorkspaceClosed(f"workspace {ws.id} is {ws._state}", workspace_id=ws.id)
    if snap.closed:
        raise ForkError(f"snapshot {snap.id} is closed", workspace_id=ws.id)
    ws._state = "starting"
    try:
        _prime_attach()
        with anyio.CancelScope(shield=True):
            await _stop_processes(ws)
        await anyio.to_thread.run_sync(shutil.rmtree, ws._dir / "upper")
        await anyio.to_thread.run_sync(shutil.rmtree, ws._dir / "work")
        (ws._dir / "work").mkdir()
        await _upper_from(ws, snap)
        await _restore(ws, snap, backend or default_backend())
        ws._state = "running"
    except BaseException:
        with anyio.CancelScope(shield=True):
            await ws._teardown()
        ws._state = "closed"
        raise


async def _upper_from(ws: Workspace, snap: Snapshot) -> None:
    """Give ``ws`` (no upper dir yet, processes stopped) the snapshot's files: an empty upper over the snapshot's
    layer chain, or, past ``MAX_LAYERS``, a copy of the top layer over the rest. ``ws`` takes its references on the
    new chain first, then lets go of its old one."""
    lower = snap.lower
    await snap._materialize()
    if len(lower.split(":")) > MAX_LAYERS:
        lower = snap.parent_lower
        await _copy_tree(snap.layer, ws._dir / "upper", workspace_id=ws.id)
    else:
        (ws._dir / "upper").mkdir()
    old = chain_layers(ws._lower or "")
    new = chain_layers(lower)
    ws._lower = lower  # from here teardown lets go of the new chain
    try:
        await anyio.to_thread.run_sync(hold_layers, new, ws.id)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(release_layers, [p for p in old if p not in new], ws.id)


async def _stop_processes(ws: Workspace) -> None:
    """Kill the tree of ``ws`` and reap its pid 1 (or shim), leaving directory and cgroup in place."""
    if ws._client is not None:
        await ws._client.aclose()
        ws._client = None
    if ws._pidfd is not None:
        try:
            signal.pidfd_send_signal(ws._pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if ws._shim is None:
            await reap_pid1(ws._pidfd)
        os.close(ws._pidfd)
        ws._pidfd = None
    if ws._shim is not None:
        await ws._shim.wait()
        await ws._shim.aclose()
        ws._shim = None
    if ws._cgroup is not None:  # stragglers outside pid 1's namespace cannot exist, but be exact
        ws._cgroup._kill_all()
        delay = 0.0005
        while ws._cgroup.pids():
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.05)
    ws.pid = None


async def _restore(ws: Workspace, snap: Snapshot, backend: CriuBackend) -> None:
    assert ws._cgroup is not None
    mode = "fs" if snap.mode == "fs" else await anyio.to_thread.run_sync(restore_mode)
    await anyio.to_thread.run_sync(_map_from, ws, snap.path if mode == "criu-cow" else None)
    if mode == "fs":
        await _restart(ws, snap)
        return
    if mode == "criu-ksm":
        await anyio.to_thread.run_sync(_ksm_enable)
    req = rpc.criu_req(type=rpc.RESTORE)
    _base_opts(req)
    req.opts.root = str(ws._dir / "root")
    req.opts.rst_sibling = True
    if snap.fresh_net:
        req.opts.inherit_fd.add(key=NET_KEY, fd=NET_FD)
    fd = os.open(snap.images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        req.opts.images_dir_fd = fd
        assert ws._lower is not None
        env, prefix = _mode_wrapper(mode)
        wrapper = prefix + _wrapper(
            ws._cgroup, ws._lower, ws._dir / "upper", ws._dir / "work", ws._dir / "root", snap.fresh_net
        )
        t0 = time.monotonic()
        try:
            resp = await backend.call(
                req,
                work_dir=ws._dir,
                log_name="restore.log",
                workspace_id=ws.id,
                wrapper=wrapper,
                env=env,
                timeout=RESTORE_TIMEOUT,
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _reap_strays(ws._cgroup)
            raise
    finally:
        os.close(fd)
    ws.restore_ms = (time.monotonic() - t0) * 1000
    ws.pid = int(resp.restore.pid)
    ws._pidfd = os.pidfd_open(ws.pid)
    ws._client = AgentClient(f"/proc/{ws.pid}/root/run/bunshin/agent.sock", ws.id)
    ws.fork_mode = mode
    ws._setup, ws.restarted_processes = list(snap.setup), []  # carried, with their pids


def _map_from(ws: Workspace, snap_dir: Path | None) -> None:
    """Make ``snap_dir`` the snapshot ``ws``'s memory is mapped from (``None``: private memory): ``ws`` holds it
    while it lives, so that dumps of ``ws`` can be incremental on its images (blocking). Its processes are gone or
    not yet there, so the old one is let go first."""
    if ws._mem_parent is not None:
        release_layers([ws._mem_parent], ws.id)
        ws._mem_parent = None
    if snap_dir is not None:
        hold_layers([snap_dir], ws.id)
        ws._mem_parent = snap_dir


async def _restart(ws: Workspace, snap: Snapshot) -> None:
    """Filesystem-only restore into ``ws`` (directory, upper over the snapshot's chain and cgroup made, no process):
    a cold start of bunshin-init, then the snapshot's recorded spawns again, in their order. Failures are
    ``ForkError``; the caller tears down what was made."""
    t0 = time.monotonic()
    ws._setup, ws.restarted_processes = [], []
    try:
        await ws._spawn()
    except (BunshinError, OSError) as exc:
        why = f"workspace {ws.id}: cold start of a filesystem-only copy failed: {exc}"
        raise ForkError(why, workspace_id=ws.id) from exc
    ws._state = "running"  # tool calls are allowed from here; on failure the caller closes it
    for step, _pid in snap.setup:
        try:
            ws.restarted_processes.append(await ws._start_step(step))
        except BunshinError as exc:
            raise ForkError(f"workspace {ws.id}: restarting `{step}` failed: {exc}", workspace_id=ws.id) from exc
    ws.restore_ms = (time.monotonic() - t0) * 1000
    ws.fork_mode = "fs"


async def reap_pid1(pidfd: int) -> None:
    """Wait for a restored pid 1 (our child through rst_sibling) to exit and reap it, so it leaves no zombie. A
    pidfd turns readable when its process exits (pidfd_open(2))."""
    await anyio.wait_readable(pidfd)
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 - WNOHANG, it has exited
    except ChildProcessError:
        pass
