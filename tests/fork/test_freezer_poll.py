"""CRIU polls the workspace's cgroup freezer every 50 us for the first 2 ms of a freeze, then every millisecond
(criu/patches/0020 on 0003, docs/concepts/fork-pause.md): a freeze that is not complete at the first read of
``freezer.state`` (about half of the time here) no longer costs the dump a 1 ms step with the
tree frozen. CRIU's log says at which poll it saw the tree frozen; the copy is the workspace's. Log lines and
answers, never timings."""

from __future__ import annotations

import re

import pytest

from bunshin_async import Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

FINE_POLL = "freezer-fine-poll"  # the feature criu/patches/0020 adds to `criu --version`


async def test_the_freeze_is_polled_finely(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")  # CRIU logs the poll that saw the tree frozen
    assert FINE_POLL in criu_features(), "CRIU lacks criu/patches/0020: run criu/build.sh"
    async with Workspace() as ws:
        await ws.write_file("/workspace/mark", "before the freeze\n")
        async with await ws.snapshot() as snap:
            log = (record_of(snap).images / "dump.log").read_text(errors="replace")
            [poll] = re.findall(r"freezer: frozen at poll (\d+) \(50 us apart for 2 ms, then 1 ms\)", log)
            assert int(poll) >= 1
            [copy] = await Workspace.from_snapshot(snap)
            try:
                assert (await copy.exec("cat /workspace/mark")).stdout == "before the freeze\n"
            finally:
                await copy.aclose()
