"""``bunshin doctor`` against this host's real package database and daemons."""

from __future__ import annotations

import re

import pytest

from bunshin_async._cli import _doctor


def test_every_package_the_setup_installs_is_present() -> None:
    """The set-up ran before the tests (the README command), so doctor must find each package it installs."""
    rows = {c.name: c for c in _doctor.checks()}
    for name, _why in _doctor.system_packages():
        assert rows[f"package {name}"].ok, rows[f"package {name}"]
    assert rows["docker engine"].ok, rows["docker engine"]


def test_a_missing_package_is_named_with_the_command_that_installs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _doctor.system_packages()
    monkeypatch.setattr(_doctor, "system_packages", lambda: [*real, ("bunshin-no-such-package", "a test")])
    text, essential_ok = _doctor.report()
    assert "MISS package bunshin-no-such-package" in text
    assert "fix: apt-get install bunshin-no-such-package" in text
    assert essential_ok  # a missing optional package does not make the host unusable
    for name, _why in real:
        assert re.search(rf"^ok +package {re.escape(name)} ", text, re.M), text
