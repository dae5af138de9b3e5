"""/etc/bunshin/host.toml: where ``bunshin setup`` records the host's CRIU, how the package finds it from any
environment, and the version check against this package's CRIU patch set."""

from __future__ import annotations

from pathlib import Path

import pytest

from bunshin_async import CapabilityMissing
from bunshin_async._cli import _doctor
from bunshin_async._fork import _modes
from bunshin_async._host import _criu, _hostsetup, _paths


@pytest.mark.unit
def test_written_and_read_back_by_both_parsers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "etc" / "host.toml"
    monkeypatch.setenv("BUNSHIN_HOST_CONFIG", str(path))
    assert _paths.host_config() == {}
    assert _hostsetup.write_host_config(criu={"path": '/opt/a "b"\\c', "patches": "x"})
    assert not _hostsetup.write_host_config(criu={"patches": "x"})  # nothing changed: the file is left alone
    assert _hostsetup.write_host_config(bunshin={"version": "9"})
    text = path.read_text()
    want = {"": {}, "criu": {"path": '/opt/a "b"\\c', "patches": "x"}, "bunshin": {"version": "9"}}
    assert _hostsetup.parse_toml(text) == want == _hostsetup.parse_toml_subset(text)
    assert _paths.host_config() == want
    with pytest.raises(ValueError):
        _hostsetup.parse_toml_subset("[criu]\npath = /unquoted\n")


def test_patch_set_matches_what_build_sh_writes() -> None:
    """criu/build.sh writes <dist>/patchset, the set-up records it; the package computes the same digest from its
    criu/ tree."""
    recorded = _paths.host_config().get("criu", {})
    assert recorded, "the host is not set up: run make setup"
    assert Path(recorded["path"]).parents[1].joinpath("patchset").read_text().strip() == recorded["patches"]
    assert recorded["patches"] == _hostsetup.patch_set()


def _fake_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, patches: str) -> Path:
    """A host whose set-up recorded a (stand-in) CRIU; the checkout's own build hidden, as in an installed wheel."""
    criu = tmp_path / "criu"
    criu.write_text("#!/bin/sh\necho 'Version: 4.2.1'\necho 'Features: cow-restore'\n")
    criu.chmod(0o755)
    monkeypatch.setenv("BUNSHIN_HOST_CONFIG", str(tmp_path / "host.toml"))
    monkeypatch.delenv("BUNSHIN_CRIU", raising=False)
    monkeypatch.setattr(_paths, "checkout_criu", lambda: None)
    _hostsetup.write_host_config(criu={"path": str(criu), "pycriu": str(tmp_path), "patches": patches})
    return criu


def test_the_host_install_is_found_from_any_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    criu = _fake_host(monkeypatch, tmp_path, _hostsetup.patch_set())
    assert _paths.criu_binary() == criu and _paths.pycriu_dir() == tmp_path
    assert _criu.criu_unavailable() is None
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "cow")
    assert _modes.restore_mode() == "criu-cow"
    monkeypatch.setenv("BUNSHIN_CRIU", "/elsewhere/criu")  # still overrides
    assert _paths.criu_binary() == Path("/elsewhere/criu")


def test_another_patch_set_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    criu = _fake_host(monkeypatch, tmp_path, "0123456789abcdef")
    why = _criu.criu_unavailable()
    assert why is not None and "patch set 0123456789abcdef" in why and "sudo bunshin setup" in why
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "cow")
    with pytest.raises(CapabilityMissing, match="0123456789abcdef") as info:
        _modes.restore_mode()
    assert info.value.capability == "criu"
    rows = {c.name: c for c in _doctor.checks()}
    assert not rows["host set-up"].ok and rows["host set-up"].remedy.startswith("sudo bunshin setup")
    monkeypatch.setenv("BUNSHIN_CRIU", str(criu))  # the user's explicit choice is taken as it is
    assert _criu.criu_unavailable() is None
