"""Where Bunshin keeps its state on the host. ``BUNSHIN_HOME`` moves all of it (default /var/lib/bunshin)."""

from __future__ import annotations

import os
from pathlib import Path

from ._config import Config

PACKAGE_DIR = Path(__file__).resolve().parent


def home() -> Path:
    return Path(os.environ.get("BUNSHIN_HOME", "/var/lib/bunshin"))


def images_dir() -> Path:
    return home() / "images"


def workspaces_dir() -> Path:
    """Per-workspace upper, work and root dirs live here (``Config.run_dir``: ``BUNSHIN_RUNDIR`` moves them); a
    clean host has this directory empty."""
    return Config.current().run_dir


def agent_layers_dir() -> Path:
    return home() / "agent"


def init_binary() -> Path:
    return PACKAGE_DIR / "bunshin-init"


def agent_binary() -> Path:
    """The static in-workspace agent (native/agent.c)."""
    return PACKAGE_DIR / "bunshin-agent"


def criu_binary() -> Path | None:
    """CRIU 4.2.1 as built by criu/build.sh (``BUNSHIN_CRIU`` overrides; then the source tree; then PATH)."""
    import shutil

    env = os.environ.get("BUNSHIN_CRIU")
    if env:
        return Path(env)
    local = PACKAGE_DIR.parent / "criu" / "dist" / "sbin" / "criu"
    if local.exists():
        return local
    found = shutil.which("criu")
    return Path(found) if found else None
