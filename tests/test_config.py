"""``Config``: the environment variables are its defaults, read when used; ``Config.configure`` overrides them for
this process, and the runtime's lookups (fork mode, snapshot store, CRIU log level, run dir, cgroup parent) follow."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin_async import Config, InvalidValue
from bunshin_async._fork import _modes
from bunshin_async._host import _criu, _kernel, _paths, _snapstore

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    yield
    Config.configure(**dict.fromkeys(Config.__struct_fields__))


def test_environment_is_read_when_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "FS")
    monkeypatch.setenv("BUNSHIN_SNAPDIR", str(tmp_path / "snaps"))
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "4")
    monkeypatch.setenv("BUNSHIN_RUNDIR", str(tmp_path / "ws"))
    monkeypatch.setenv("BUNSHIN_CGROUP_PARENT", "bunshin-test-config")
    config = Config.current()
    assert (config.fork_mode, config.criu_log_level, config.cgroup_parent) == ("fs", 4, "bunshin-test-config")
    assert _modes.restore_mode() == "fs" and _modes.fs_only()
    assert _snapstore.snapshot_dir() == tmp_path / "snaps"
    assert _paths.workspaces_dir() == tmp_path / "ws"
    assert _kernel.parent_name() == "bunshin-test-config"
    monkeypatch.delenv("BUNSHIN_CRIU_LOG_LEVEL")
    assert Config.current().criu_log_level == 2


def test_configure_overrides_and_resets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "criu")
    config = Config.configure(fork_mode="fs", snapshot_dir=str(tmp_path), criu_log_level=0)
    assert config == Config.current() and config.snapshot_dir == tmp_path  # a str path becomes a Path
    assert _modes.restore_mode() == "fs" and _snapstore.snapshot_dir() == tmp_path
    if _criu.rpc is not None:
        req = _criu.rpc.criu_req(type=_criu.rpc.DUMP)
        _criu.base_opts(req)
        assert req.opts.log_level == 0
    Config.configure(fork_mode=None)  # back to the environment; the others stay
    assert Config.current().fork_mode == "criu" and Config.current().snapshot_dir == tmp_path


def test_bad_settings_are_refused_and_change_nothing() -> None:
    before = Config.current()
    with pytest.raises(InvalidValue, match="unknown settings") as unknown:
        Config.configure(fork_moed="fs")
    with pytest.raises(InvalidValue) as wrong:  # also the ValueError it was
        Config.configure(criu_log_level="verbose")
    assert (unknown.value.argument, wrong.value.argument) == ("fork_moed", "criu_log_level")
    assert isinstance(wrong.value, ValueError)
    assert Config.current() == before


def test_allow_missing_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BUNSHIN_FORK_MODE", raising=False)
    assert Config.current().allow_missing == frozenset() and Config.current().fork_mode == "cow"
    monkeypatch.setenv("BUNSHIN_ALLOW_MISSING", " Snapshot Store,cgroup pids ,")
    assert Config.current().allow_missing == {"snapshot store", "cgroup pids"}
    assert Config.configure(allow_missing="ksm").allow_missing == {"ksm"}
    assert Config.configure(allow_missing=["KSM", "criu"]).allow_missing == {"ksm", "criu"}
    Config.configure(allow_missing=None)
    assert Config.current().allow_missing == {"snapshot store", "cgroup pids"}
