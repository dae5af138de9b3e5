"""The snapshot store and the layer chain: where snapshots and their read-only upper layers live, and the
reference counting (one owner-token file per user in ``<id>.users/``) that deletes a layer or snapshot directory
with its last user (package doc, ``bunshin_async._fork``)."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio

from .._config import Config
from .._exceptions import CapabilityMissing, ForkError, StoreFull
from . import _kernel, _tree
from ._dirlock import lock_dir
from ._threads import join_thread


def snapshot_dir() -> Path:
    """Where snapshots live; a tmpfs, so that images and the upper copy cost no disk I/O (see
    ``prepare_snapshot_store``)."""
    return Config.current().snapshot_dir


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
    from .. import _native

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
    In the snapshot store, a tmpfs, as a workspace's upper dir is (``Limits.disk``, on by default): a file seen
    through a layer must stat as it did in the parent's upper dir (a directory's size and block count differ
    between tmpfs and a disk filesystem: ``ls -la`` and ``du`` in a copy must print what they printed in the
    parent), and the first restore renames the dump's upper copy into place instead of copying it. (A workspace
    with ``Limits(disk=None)`` has its upper dir on the host's filesystem: its copies see tmpfs sizes.)"""
    return snapshot_dir() / ".layers"


MAX_LAYERS = 40
"""Longest lower chain a restore stacks (the agent layer and image included); past it the top layer is copied."""

MAX_MEM_CHAIN = 15
"""Longest chain of incremental memory images (criu/patches/0002): a dump of a copy whose chain is this long
writes all its memory again, and the copy is restored in place from it (``_fork._restore.rebase``), so restores open
at most this many images (the patch's limit, ``COW_MAX_SRC``, is 16) and the copy's later dumps are incremental on
the new image. As long as the patch allows: a cut copies every page the copy maps into a new image, which doubles
its memory while older layers are held elsewhere (the cache's captures, siblings), and a rollout that commits a
speculated write at every turn forks once per call (at 8, the terminal workload's stragglers cut their chains once
or twice, each adding a full image of ~66 MiB for the rest of the run)."""

lock = threading.RLock()
"""Held while reference files are written or layers deleted (``bunshin_async._fork._transfer`` installs under it)."""


@contextlib.contextmanager
def store_lock(exclusive: bool = False) -> Iterator[None]:
    """``lock``, and the store's lock between processes (``_dirlock``): shared while an entry (a snapshot directory,
    a layer) is made and its users written (``hold_layers`` takes it; a caller that makes the entry takes it around
    both), exclusive while a collection reads users and deletes (``collect_layers``). So ``bunshin gc`` run beside
    other processes never sees a directory whose users are not written yet, nor a token half written (blocking: a
    collection holds it while it deletes)."""
    with lock:
        fd = lock_dir(snapshot_dir(), exclusive=exclusive, make=True)
        assert fd is not None
        try:
            yield
        finally:
            os.close(fd)


def chain_layers(lower: str) -> list[Path]:
    """The snapshot layers in a lowerdir chain (not the agent layer or image, which are not reference-counted)."""
    base = layers_dir()
    return [Path(p) for p in lower.split(":") if Path(p).parent == base]


def _users(layer: Path) -> Path:
    return layer.with_name(layer.name + ".users")


def hold_layers(layers: list[Path], user: str) -> None:
    """Register ``user`` on each layer (blocking). The caller must already hold them through a live user."""
    token = _kernel.owner_token(os.getpid())
    with store_lock():
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
    with lock:
        for layer in layers:
            users = _users(layer)
            (users / user).unlink(missing_ok=True)
            try:
                users.rmdir()
            except OSError:  # other users remain (or it is already gone)
                if users.exists():
                    continue
            parent = mem_parent_of(layer)
            _tree.remove_tree(layer, ignore_errors=True)
            if parent is not None:
                release_layers([parent], f"child-{layer.name}")
        try:
            layers_dir().rmdir()
        except OSError:
            pass


def mem_parent_of(snap_dir: Path) -> Path | None:
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
        cur = mem_parent_of(cur)
    return depth


def collect_layers(proven: bool = False) -> list[str]:
    """``bunshin gc``: delete the layers and snapshot directories whose users are all dead processes (blocking),
    under the store's exclusive lock (``store_lock``): an entry another process is making has its users written in
    the same shared section, so a directory with none is left over. ``proven``: only those with users, all dead;
    what a start collects by itself while others run."""
    if not snapshot_dir().is_dir():
        return []
    with store_lock(exclusive=True):
        return _collect(layers_dir(), "layer", proven) + _collect(snapshot_dir(), "snapshot", proven)


def _live(users: Path) -> tuple[list[str], list[str]]:
    """The tokens in a users directory (``hold_layers``; none if it is not one) and those of live processes."""
    tokens = [_kernel.read_token(u) or "" for u in users.iterdir()] if users.is_dir() else []
    return tokens, [t for t in tokens if _kernel.alive(t)]


def _collect(base: Path, what: str, proven: bool) -> list[str]:
    out: list[str] = []
    for entry in sorted(base.iterdir()) if base.exists() else []:
        if entry.name.endswith(".users") or entry == layers_dir():  # the layers: collected on their own
            continue
        users = _users(entry.with_name(entry.name.removesuffix(".partial")))  # a layer being made
        tokens, alive = _live(users)
        if alive:
            out.append(f"kept {what} {entry.name} ({len(alive)} live users)")
            continue
        if proven and not tokens:
            continue
        out += _kernel.detach_mounts(entry)  # a run scope's own tmpfs (accounting_scope), what a tool left
        _tree.remove_tree(users, ignore_errors=True)
        _tree.remove_tree(entry, ignore_errors=True)
        out.append(f"removed {what} {entry.name}")
    # Users of an entry not there (yet): a snapshot's layer before its first restore makes it (``materialize``),
    # an import's staging; kept while one of them lives.
    for users in sorted(base.glob("*.users")) if base.exists() else []:
        if not users.with_name(users.name[: -len(".users")]).exists():
            tokens, alive = _live(users)
            if not alive and (tokens or not proven):
                _tree.remove_tree(users, ignore_errors=True)
    with contextlib.suppress(OSError):
        base.rmdir()
    return out


async def copy_tree(src: Path, dst: Path, *, workspace_id: str = "") -> int:
    """Copy the directory ``src`` (a workspace's upper dir or a snapshot's layer: hostile content) to ``dst``
    (which must not exist) as ``cp -a`` does, from descriptors (``bunshin_async._host._tree``: no symlink followed, no
    PATH_MAX limit, holes kept, overlay's trusted.* xattrs kept); returns the bytes the copy holds
    (``_tree.Copied``). A failed copy is a ``ForkError`` and leaves no ``dst``: a snapshot or copy with missing
    files must never be used."""
    try:
        return (await anyio.to_thread.run_sync(_tree.copy_tree, src, dst)).bytes
    except OSError as exc:
        raise _copy_failed(src, dst, exc, workspace_id) from exc


def _copy_failed(src: Path, dst: Path, exc: OSError, workspace_id: str) -> ForkError:
    return ForkError(f"copying {src} to {dst} failed: {exc.strerror or exc}", workspace_id=workspace_id)


class TreeCopy:
    """A ``copy_tree`` that runs in a thread of its own (``start``, not awaited) and is waited for later
    (``finish``): a dump starts the upper dir's copy as soon as CRIU has frozen the tree, so that it runs beside
    CRIU's dump instead of after it. ``prepare`` makes the thread beforehand, idle until ``start``: starting a thread
    waits until it runs (0.16 ms median, 3 ms p90 at load 4 on a 2-core host), which is then not in the freeze.
    ``finish`` without a ``start`` copies there and then and returns the bytes the copy holds; ``join`` (shielded)
    only waits, whatever happened, so that no copy outlives its snapshot (a prepared copy never started copies
    nothing)."""

    def __init__(self, src: Path, dst: Path, workspace_id: str = "") -> None:
        self.src, self.dst, self.workspace_id = src, dst, workspace_id
        self._thread: threading.Thread | None = None
        self._go = threading.Event()
        self._copy = False  # set before ``_go``: copy (``start``), or leave without copying (``join``)
        self._error: OSError | None = None
        self._bytes = 0

    def prepare(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bunshin-tree-copy", daemon=True)
            self._thread.start()

    def start(self) -> None:
        self.prepare()
        if not self._go.is_set():
            self._copy = True
            self._go.set()

    def _run(self) -> None:
        self._go.wait()
        if not self._copy:
            return
        try:
            self._bytes = _tree.copy_tree(self.src, self.dst).bytes
        except OSError as exc:
            self._error = exc

    async def finish(self) -> int:
        if not self._copy:
            if self._thread is not None:  # prepared, never started: let the idle thread go, copy here
                self._go.set()
            return await copy_tree(self.src, self.dst, workspace_id=self.workspace_id)
        await self.join()
        if self._error is not None:
            raise _copy_failed(self.src, self.dst, self._error, self.workspace_id) from self._error
        return self._bytes

    async def join(self) -> None:
        if self._thread is None:
            return
        self._go.set()  # a prepared copy never started leaves without copying
        await join_thread(self._thread)


def store_full(exc: BaseException, workspace_id: str, *, dump: bool = True) -> StoreFull | None:
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
