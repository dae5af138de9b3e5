"""Memory modes of the copies (``ws.fork_mode``, chosen by ``Config.fork_mode``; package doc): which one the next
restore gets, what environment and wrapper give CRIU that mode, and KSM's settings while ``criu-ksm`` is used."""

from __future__ import annotations

import atexit
import sys
import threading
from pathlib import Path

from .._config import Config
from .._criu import COW_RESTORE, criu_features, criu_unavailable
from .._exceptions import CapabilityMissing, InvalidValue
from ._layers import snapshot_dir

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


def restore_mode() -> ForkMode:
    """The ``fork_mode`` the next restore gets, from ``Config.fork_mode`` (``BUNSHIN_FORK_MODE``): ``auto``
    (default: ``criu-cow`` when the patched CRIU is present, else ``criu``, and ``fs`` when CRIU is unusable),
    ``cow``, ``criu`` (alias ``stock``), ``ksm`` or ``fs``. A mode the host cannot provide raises
    ``CapabilityMissing``; nothing falls back silently except ``auto``, and its ``fs`` shows in ``ws.fork_mode``
    and ``bunshin doctor``."""
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
    raise InvalidValue(f"BUNSHIN_FORK_MODE={want!r}: expected auto, cow, criu, ksm or fs", argument="fork_mode")


def _wanted_mode() -> str:
    return Config.current().fork_mode.strip().lower() or "auto"


def fs_only() -> bool:
    """Whether a snapshot taken now is filesystem-only (``BUNSHIN_FORK_MODE=fs``, or ``auto`` with CRIU unusable).
    Unlike ``restore_mode`` it never raises: the CRIU modes are a restore's choice, made per restore."""
    want = _wanted_mode()
    return want == "fs" or (want == "auto" and criu_unavailable() is not None)


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
