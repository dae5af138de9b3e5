"""``LastPid``'s helper seen from the host: a helper that ended before it was asked is reported once, with its own
answer (pure logic around a fake helper: no root, no workspace)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import anyio
import psutil
import pytest

from bunshin_async._host import _paths, _pidns

pytestmark = pytest.mark.unit


async def test_a_helper_gone_before_it_is_asked_is_reported_once_with_its_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    helper = tmp_path / "helper"
    helper.write_text("#!/bin/sh\necho 'E setns: No such process'\nexit 1\n")
    helper.chmod(0o755)
    monkeypatch.setattr(_paths, "init_binary", lambda: helper)
    last = _pidns.LastPid(os.getpid(), tmp_path)
    last.start()
    with anyio.fail_after(30):  # the helper has ended (a zombie until the thread waits for it): asking breaks a pipe
        while not _ended_child():
            await anyio.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="bunshin_async.fork"):
        assert await last.finish() is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "bunshin_async.fork"]
    assert warnings == [f"pid {os.getpid()}: its pid namespace's last pid: E setns: No such process"], warnings
    assert not (tmp_path / _pidns.LAST_PID_IMG).exists()


def _ended_child() -> bool:
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            pass
    return False
