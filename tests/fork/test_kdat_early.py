"""CRIU probes the kernel's features before the dump's request, not after it (criu/patches/0025, issue 39): even with
its kdat cache loaded, ``kerndat_init()`` forks and ptrace-attaches a child on every run (0.6-0.8 ms quiet, several
ms under load), and the request is what the workspace's pause starts with. A CRIU asked for its VERSION with
``keep_open`` (a dump or restore follows: ``CriuBackend.call``'s ``ready``) probes then; one that gets its request
straight away probes at the request, as before. Log lines and answers, never timings."""

from __future__ import annotations

import pytest

from bunshin_async import Workspace
from bunshin_async._fork import _dump
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

KDAT_EARLY = "kdat-early"  # the feature criu/patches/0025 adds to `criu --version`
EARLY = "kdat: probed before the request"


@pytest.mark.parametrize("overlap", [True, False])
async def test_the_kernel_is_probed_before_the_request(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")
    monkeypatch.setattr(_dump, "OVERLAP", overlap)  # False: CRIU starts after the drain and gets the request first
    assert KDAT_EARLY in criu_features(), "CRIU lacks criu/patches/0025: run criu/build.sh"
    async with Workspace() as ws:
        await ws.write_file("/workspace/mark", "before the dump\n")
        async with await ws.snapshot() as snap:
            log = (record_of(snap).images / "dump.log").read_text(errors="replace")
            request = log.index("Will dump/restore TCP connections")  # check_options(), once the request is set up
            if overlap:
                assert log.count(EARLY) == 1 and log.index(EARLY) < request
            else:
                assert EARLY not in log
                assert log.index("Loaded kdat cache") < request  # probed at the request, as stock CRIU does
            [copy] = await Workspace.from_snapshot(snap)
            try:
                assert (await copy.exec("cat /workspace/mark")).stdout == "before the dump\n"
                assert (await copy.exec("echo $((6 * 7))")).stdout == "42\n"
            finally:
                await copy.aclose()
