"""The one rule for every capability Bunshin could go on without: no silent downgrade.

Where the host lacks something a setting asks for (a patched CRIU for ``fork_mode="cow"``, the snapshot store, a
cgroup controller for a limit, the disk bound), the caller calls ``fallback``. It raises ``CapabilityMissing`` naming
what is missing and the fix, unless the user accepted the weaker path: a setting documented as "best available"
(``fork_mode="auto"``) or the capability listed in ``Config.allow_missing`` (``BUNSHIN_ALLOW_MISSING``). Then it logs
ONE warning per process and capability naming what is lost, and the caller takes the weaker path.
"""

from __future__ import annotations

import logging
import threading

from ._config import Config
from ._exceptions import CapabilityMissing

__all__ = ["fallback", "reset_warnings"]

log = logging.getLogger("bunshin_async")

_lock = threading.Lock()
_warned: set[str] = set()


def fallback(capability: str, *, missing: str, lost: str, remedy: str, allowed: bool = False) -> None:
    """``capability`` cannot be had (``missing`` says why, ``remedy`` how to get it; ``lost`` what the weaker path
    gives up). Raises ``CapabilityMissing`` unless ``allowed`` (the caller's own best-available setting) or the
    capability is in ``Config.allow_missing``; otherwise warns once per process and capability, and returns so the
    caller degrades."""
    accepted = Config.current().allow_missing
    if not (allowed or capability in accepted or "all" in accepted):
        raise CapabilityMissing(missing, capability=capability, remedy=remedy)
    with _lock:
        if capability in _warned:
            return
        _warned.add(capability)
    log.warning("%s: %s; going on without it, which loses %s (fix: %s)", capability, missing, lost, remedy)


def reset_warnings() -> None:
    """Forget which capabilities were warned about (tests, and a process that fixed its host)."""
    with _lock:
        _warned.clear()
