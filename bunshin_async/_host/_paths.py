"""Where Bunshin keeps its state on the host. ``BUNSHIN_HOME`` moves all of it (default /var/lib/bunshin)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .._config import Config
from . import _hostsetup

PACKAGE_DIR = Path(__file__).resolve().parent.parent


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


def criu_roots_dir() -> Path:
    """An empty directory the restore wrapper mounts a tmpfs on, in its own mount namespace, for CRIU's mount roots
    (``bunshin-init --mnt-roots``, criu/patches/0037); on the host it stays empty. Not under ``BUNSHIN_HOME``: the
    restored tree's root, mapped in its user namespace, walks to it, and a home may sit under a 0700 directory (a
    test's temporary one did)."""
    return Path("/run/bunshin-criu-roots")


def init_binary() -> Path:
    return PACKAGE_DIR / "bunshin-init"


def agent_binary() -> Path:
    """The static in-workspace agent (native/agent.c)."""
    return PACKAGE_DIR / "bunshin-agent"


def host_config() -> dict[str, dict[str, str]]:
    """/etc/bunshin/host.toml (``BUNSHIN_HOST_CONFIG`` moves it), where ``bunshin setup`` records the host's parts;
    empty when the host was not set up. Re-read when the file changes."""
    path = _hostsetup.host_config_path()
    try:
        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        cached = _host_cache.get(key)
        if cached is not None:
            return cached
        data = _hostsetup.parse_toml(path.read_text())
    except (OSError, ValueError):
        return {}
    _host_cache.clear()
    _host_cache[key] = data
    return data


_host_cache: dict[tuple[str, int, int], dict[str, dict[str, str]]] = {}


def checkout_criu() -> Path | None:
    """A checkout's own CRIU build (criu/dist beside the package: a development tree, never an installed wheel)."""
    local = PACKAGE_DIR.parent / "criu" / "dist"
    return local if (local / "sbin" / "criu").exists() else None


def criu_binary() -> Path | None:
    """CRIU 4.2.1 with criu/patches: ``BUNSHIN_CRIU``, else a checkout's own build (criu/dist), else the host's
    install recorded in host.toml by ``bunshin setup``, else PATH."""
    env = os.environ.get("BUNSHIN_CRIU")
    if env:
        return Path(env)
    local = checkout_criu()
    if local is not None:
        return local / "sbin" / "criu"
    recorded = host_config().get("criu", {}).get("path")
    if recorded:
        return Path(recorded)
    found = shutil.which("criu")
    return Path(found) if found else None


def pycriu_dir() -> Path | None:
    """Where ``pycriu`` (CRIU's RPC bindings, built with it) is: the checkout's build, else the host's install."""
    local = checkout_criu()
    if local is not None:
        return local / "python"
    recorded = host_config().get("criu", {}).get("pycriu")
    return Path(recorded) if recorded else None
