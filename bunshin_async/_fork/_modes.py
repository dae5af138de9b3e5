"""Memory modes of the copies (``ws.fork_mode``, chosen by ``Config.fork_mode``; package doc): which one the next
restore gets, what environment and wrapper give CRIU that mode, and KSM's settings while ``criu-ksm`` is used."""

from __future__ import annotations

import atexit
import sys
import threading
from pathlib import Path

import msgspec

from .._config import Config
from .._exceptions import CapabilityMissing, InvalidValue
from .._fallback import fallback
from .._host import _paths
from .._host._criu import COW_RESTORE, criu_features, criu_unavailable
from .._host._snapstore import prepare_snapshot_store, snapshot_dir, snapshot_store

ForkMode = str
"""How a workspace came to be: ``"fresh"`` (started cold), ``"criu"`` (restored from a CRIU snapshot, private
memory), ``"criu-cow"`` (restored sharing the snapshot's memory pages until written), ``"criu-ksm"`` (restored into
KSM-mergeable tasks), ``"fs"`` (files only: started cold over the snapshot's files, its recorded processes
restarted, no memory carried)."""


def cow_available() -> bool:
    """Whether the CRIU in use carries the CoW-restore patch (``criu --version`` lists ``Features: cow-restore``)."""
    return COW_RESTORE in criu_features()


KSM_DIR = Path("/sys/kernel/mm/ksm")
KSM_TUNING = {"run": "1", "pages_to_scan": "2000", "sleep_millisecs": "10"}
"""What ``criu-ksm`` mode writes to /sys/kernel/mm/ksm: about 200k pages (800 MiB) scanned per second."""

SETUP_FIX = (
    "run `sudo bunshin setup` (`make setup` in a checkout), or set BUNSHIN_CRIU to a CRIU 4.2.1 built with criu/patches"
)
"""The remedy for a missing or unpatched CRIU."""

_MODES = {"auto": "auto", "cow": "criu-cow", "criu-cow": "criu-cow", "criu": "criu", "stock": "criu",
          "ksm": "criu-ksm", "criu-ksm": "criu-ksm", "fs": "fs"}  # fmt: skip


class Loss(msgspec.Struct, frozen=True):
    """A capability the wanted fork mode needs and the host lacks (``_fallback.fallback``'s arguments)."""

    capability: str
    missing: str
    lost: str
    remedy: str


def plan() -> tuple[ForkMode, list[Loss]]:
    """The ``fork_mode`` the next restore gets and what it lacks, without acting on it (``bunshin doctor`` shows
    this). For ``auto`` the mode is the best the host has and the losses are what it gave up; for any other mode the
    mode is the one asked for and a loss means it cannot be had."""
    want = _wanted_mode()
    mode = _MODES.get(want)
    if mode is None:
        raise InvalidValue(f"BUNSHIN_FORK_MODE={want!r}: expected cow, criu, ksm, fs or auto", argument="fork_mode")
    if mode == "fs":
        return "fs", []
    reason = criu_unavailable()
    if reason is not None:
        loss = Loss("criu", f"fork_mode={want!r} needs CRIU: {reason}", _FS_LOSES, SETUP_FIX)
        return ("fs" if want == "auto" else mode), [loss]
    if mode in ("auto", "criu-cow") and not cow_available():
        loss = Loss(
            "criu-cow",
            f"fork_mode={want!r} needs a CRIU with criu/patches (0001-cow-restore): {_paths.criu_binary()} lacks it",
            "memory sharing between copies (each copy reads its whole memory)",
            SETUP_FIX,
        )
        return "criu", [loss]
    if mode == "criu-ksm" and not (KSM_DIR / "run").exists():
        return mode, [Loss("ksm", "fork_mode='ksm' but the kernel has no KSM", "same-page merging", "CONFIG_KSM=y")]
    return ("criu-cow" if mode == "auto" else mode), []


_FS_LOSES = (
    "live fork: copies are filesystem-only (processes started with spawn are restarted, memory, shell sessions "
    "and connections are not carried)"
)


def restore_mode() -> ForkMode:
    """The ``fork_mode`` the next restore gets, from ``Config.fork_mode`` (``BUNSHIN_FORK_MODE``): ``cow`` (default,
    ``criu-cow``), ``criu`` (alias ``stock``), ``ksm``, ``fs`` or ``auto`` (the best the host has). A mode the host
    cannot provide raises ``CapabilityMissing`` naming the missing part and the fix; only ``auto`` degrades, with one
    warning per process naming what was lost (``_fallback``)."""
    mode, losses = plan()
    auto = _wanted_mode() == "auto"
    for loss in losses:
        fallback(loss.capability, missing=loss.missing, lost=loss.lost, remedy=loss.remedy, allowed=auto)
    return mode


def _wanted_mode() -> str:
    return Config.current().fork_mode.strip().lower() or "cow"


def fs_only() -> bool:
    """Whether a snapshot taken now is filesystem-only (``fork_mode="fs"``, or ``auto`` with CRIU unusable); raises
    like ``restore_mode`` when the mode cannot be had, and checks the snapshot store a CRIU dump writes to
    (blocking)."""
    if restore_mode() == "fs":
        return True
    check_snapshot_store()
    return False


_store_ok: set[tuple[str, int]] = set()


def _store_key(base: Path) -> tuple[str, int]:
    try:
        return str(base), base.stat().st_dev
    except OSError:
        return str(base), -1


def check_snapshot_store() -> None:
    """The snapshot store must be a tmpfs with large folios (``_layers.snapshot_store``): mounted here when it is
    missing and can be (root, an empty directory, as ``bunshin snapstore`` does), else ``fallback`` (``auto``
    and ``allow_missing`` go on with slower dumps). Checked once per store and mount (blocking)."""
    base = snapshot_dir()
    if _store_key(base) in _store_ok:
        return
    ok, where = snapshot_store()
    why = ""
    if not ok:
        try:
            prepare_snapshot_store()
        except CapabilityMissing as exc:
            why = f" ({exc})"
        ok, where = snapshot_store()
    if ok:
        _store_ok.add(_store_key(base))
        return
    fallback(
        "snapshot store",
        missing=f"the snapshot store is not a tmpfs with large folios: {where}{why}",
        lost="fast dumps and restores (page images on 4 KiB pages or on disk)",
        remedy="run `sudo bunshin snapstore` (`bunshin setup` does), or point BUNSHIN_SNAPDIR at a tmpfs mounted "
        "with huge=within_size",
        allowed=_wanted_mode() == "auto",
    )


def cow_prefix() -> str:
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


def ksm_enable() -> None:
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


def mode_wrapper(mode: ForkMode) -> tuple[dict[str, str], list[str]]:
    """The environment and command prefix (it ends by exec'ing the rest) that give a restore's CRIU its memory
    mode."""
    if mode == "criu-cow":
        return {"CRIU_COW_RESTORE": "1", "CRIU_COW_ANON_PREFIX": cow_prefix()}, []
    if mode == "criu-ksm":
        return {}, [sys.executable, "-I", "-S", "-c", _KSM_SHIM]
    return {}, []


def dump_env() -> dict[str, str]:
    """Dumps always recognise CoW-restored memory when CRIU can (the workspace may be such a copy)."""
    return {"CRIU_COW_ANON_PREFIX": cow_prefix()} if cow_available() else {}
