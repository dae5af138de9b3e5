"""``Config``: the host-wide settings of the runtime, with the environment variables as defaults.

    Config.configure(fork_mode="fs", snapshot_dir="/dev/shm/my-snaps")   # this process, from now on
    Config.current().fork_mode                                           # what the next fork uses

A setting the host cannot honour raises ``CapabilityMissing`` rather than quietly doing less (``_fallback``):
``fork_mode="auto"`` and ``allow_missing`` are how a user accepts less.

Each field left unset is read from its environment variable when it is used, not at import, so a variable set
before the first workspace (a test's fixture, a Ray actor's runtime env) still counts.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

import msgspec

from ._exceptions import InvalidValue

__all__ = ["Config"]


def _env(name: str, default: str) -> str:
    return os.environ.get(name, "").strip() or default


_YES = ("1", "true", "yes", "on")


def _names(text: str) -> frozenset[str]:
    return frozenset(n.strip().lower() for n in text.split(",") if n.strip())


def _run_dir() -> Path:
    run = os.environ.get("BUNSHIN_RUNDIR")
    return Path(run) if run else Path(os.environ.get("BUNSHIN_HOME", "/var/lib/bunshin")) / "ws"


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of the runtime (see the module doc). ``fork_mode`` (``BUNSHIN_FORK_MODE``): ``cow`` (default: live
    copies sharing memory, needs the patched CRIU), ``criu``, ``ksm``, ``fs`` (files only) or ``auto`` (the best
    the host has, one warning naming what is lost; ``bunshin_async._fork._modes``). ``snapshot_dir``
    (``BUNSHIN_SNAPDIR``): the snapshot store, a tmpfs. ``criu_log_level`` (``BUNSHIN_CRIU_LOG_LEVEL``, 0-4):
    CRIU's dump.log/restore.log detail.
    ``run_dir`` (``BUNSHIN_RUNDIR``, else ``$BUNSHIN_HOME/ws``): the workspaces' directories. ``cgroup_parent``
    (``BUNSHIN_CGROUP_PARENT``): the cgroup all workspaces live under. ``allow_missing``
    (``BUNSHIN_ALLOW_MISSING``, comma-separated): capabilities the runtime may go on without, with one warning each,
    instead of raising ``CapabilityMissing`` (``"all"`` for every one; names as in ``CapabilityMissing.capability``:
    ``criu``, ``criu-cow``, ``snapshot store``, ``cgroup memory``, ...). ``track_writes``
    (``BUNSHIN_TRACK_WRITES``, off by default): dumps of a workspace that is no CoW copy track its writes
    (criu/patches/0013), so the next snapshot of it writes, and pauses it for, only the pages written since."""

    fork_mode: str = msgspec.field(default_factory=lambda: _env("BUNSHIN_FORK_MODE", "cow").lower())
    snapshot_dir: Path = msgspec.field(default_factory=lambda: Path(_env("BUNSHIN_SNAPDIR", "/dev/shm/bunshin-snap")))
    criu_log_level: int = msgspec.field(default_factory=lambda: int(_env("BUNSHIN_CRIU_LOG_LEVEL", "2")))
    run_dir: Path = msgspec.field(default_factory=_run_dir)
    cgroup_parent: str = msgspec.field(default_factory=lambda: _env("BUNSHIN_CGROUP_PARENT", "bunshin"))
    allow_missing: frozenset[str] = msgspec.field(default_factory=lambda: _names(_env("BUNSHIN_ALLOW_MISSING", "")))
    track_writes: bool = msgspec.field(default_factory=lambda: _env("BUNSHIN_TRACK_WRITES", "0") in _YES)

    @staticmethod
    def current() -> Config:
        """The configuration in force: what ``configure`` set, the environment for the rest (read now)."""
        return Config(**{**msgspec.structs.asdict(Config()), **_overrides, **_scoped.get()})

    @staticmethod
    def process() -> Config:
        """The process-wide configuration: ``configure``'s settings and the environment, without a ``scoped``
        block's (what outlives a run's scope: the run dir, the store and the cgroup parent that ``bunshin gc``
        and a start's collection of dead processes' leftovers look at)."""
        return Config(**{**msgspec.structs.asdict(Config()), **_overrides})

    @staticmethod
    def configure(**changes: object) -> Config:
        """Set fields of the process-wide configuration (``None`` puts one back to its environment default);
        returns the configuration now in force. Applies to operations started afterwards, in this process only (a
        worker process or a Ray actor reads its own environment)."""
        _check_known(changes)
        new = {k: v for k, v in _overrides.items() if k not in changes}
        new.update({k: _coerce(k, v) for k, v in changes.items() if v is not None})
        config = _convert({**msgspec.structs.asdict(Config()), **new}, changes)
        _overrides.clear()
        _overrides.update({k: getattr(config, k) for k in new})  # checked (strict=False: "3" is a log level too)
        return config

    @staticmethod
    @contextlib.contextmanager
    def scoped(**changes: object) -> Iterator[Config]:
        """``with Config.scoped(cgroup_parent=...):`` the settings in force for this task and what it starts from
        inside (anyio tasks and worker threads copy the context they start in), on top of ``configure``'s; yields
        the configuration in force. Why: a run measured on its own (``_accounting.accounting_scope``) puts what it
        creates under its own cgroup parent and snapshot directory while other tasks of the process go on as before."""
        _check_known(changes)
        new = {k: Path(v) if k in _PATHS and isinstance(v, str) else v for k, v in changes.items() if v is not None}
        merged = {**_scoped.get(), **new}
        config = _convert({**msgspec.structs.asdict(Config.current()), **merged}, changes)
        token = _scoped.set({k: getattr(config, k) for k in merged})
        try:
            yield config
        finally:
            _scoped.reset(token)


def _check_known(changes: Mapping[str, object]) -> None:
    unknown = set(changes) - set(Config.__struct_fields__)
    if unknown:
        raise InvalidValue(
            f"unknown settings {sorted(unknown)}; known: {list(Config.__struct_fields__)}", argument=min(unknown)
        )


def _convert(values: dict[str, object], changes: Mapping[str, object]) -> Config:
    """``values`` as a checked ``Config`` (``strict=False``: "3" is a log level too); a value of the wrong type is
    an ``InvalidValue`` naming the setting."""
    try:
        return msgspec.convert(values, Config, strict=False)
    except msgspec.ValidationError as exc:
        field = str(exc).rpartition("$.")[2].split("`")[0].split("[")[0] or ",".join(sorted(changes))
        raise InvalidValue(f"Config: {exc}", argument=field) from exc


def _coerce(name: str, value: object) -> object:
    """A str path becomes a Path; ``allow_missing`` takes a comma-separated str or an iterable of names."""
    if name in _PATHS and isinstance(value, str):
        return Path(value)
    if name == "allow_missing":
        names = value.split(",") if isinstance(value, str) else value
        if isinstance(names, (list, tuple, set, frozenset)):
            return _names(",".join(str(n) for n in names))
    return value


_overrides: dict[str, object] = {}
_scoped: contextvars.ContextVar[Mapping[str, object]] = contextvars.ContextVar(
    "bunshin_config_scoped", default=MappingProxyType({})
)
_PATHS = ("snapshot_dir", "run_dir")
