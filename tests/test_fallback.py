"""``_fallback.fallback``: the one rule for a capability the host lacks (raise, or with the user's consent warn
once per process), as the cgroup limits apply it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from bunshin_async import CapabilityMissing, Config, Limits
from bunshin_async._fallback import fallback, reset_warnings
from bunshin_async._host import _kernel

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    reset_warnings()
    yield
    Config.configure(allow_missing=None)
    reset_warnings()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bunshin_async" and r.levelno == logging.WARNING]


def test_raises_unless_allowed_then_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    args = {"missing": "no frobnicator", "lost": "frobbing", "remedy": "apt-get install frob"}
    with pytest.raises(CapabilityMissing, match=r"no frobnicator \(apt-get install frob\)") as info:
        fallback("frob", **args)
    assert (info.value.capability, info.value.remedy) == ("frob", "apt-get install frob")
    assert not _warnings(caplog)
    for _ in range(3):
        fallback("frob", allowed=True, **args)
    assert _warnings(caplog) == [
        "frob: no frobnicator; going on without it, which loses frobbing (fix: apt-get install frob)"
    ]
    fallback("other", allowed=True, **args)
    assert len(_warnings(caplog)) == 2  # once per capability


def test_a_limit_without_its_controller_is_not_dropped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(CapabilityMissing, match=r"Limits\(pids=...\) needs the cgroup pids controller") as info:
        _kernel._require_controllers(Limits(memory=None, pids=64), {"memory", "cpu"})
    assert info.value.capability == "cgroup pids"
    _kernel._require_controllers(Limits(memory=None, pids=None, cpus=1.0), {"cpu"})  # what is asked for is there
    monkeypatch.setenv("BUNSHIN_ALLOW_MISSING", "cgroup pids, cgroup cpu")
    _kernel._require_controllers(Limits(memory=None, pids=64, cpus=1.0), set())
    _kernel._require_controllers(Limits(memory=None, pids=64, cpus=1.0), set())
    assert [w.split(":")[0] for w in _warnings(caplog)] == ["cgroup pids", "cgroup cpu"]
    with pytest.raises(CapabilityMissing, match="cgroup memory"):  # not accepted
        _kernel._require_controllers(Limits(), set())
    Config.configure(allow_missing="all")
    _kernel._require_controllers(Limits(), set())
    assert "cgroup memory" in _warnings(caplog)[-1]
