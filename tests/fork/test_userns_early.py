"""A dump's CRIU checks that the workspace's namespaces belong to its user namespace (a fork of CRIU that takes the
user namespace root's ids and ``setns()``es into each) when it answers the ready check, before the workspace is
drained and frozen, not with the tree frozen (criu/patches/0028, issue 39: 0.5-0.7 ms quiet, a few ms loaded). The
dump reuses that check only for the very task it dumps in the very same namespaces; told another task, it checks
frozen, as before. CRIU's log says which (level 3); copies are checked by their answers, never by timing."""

from __future__ import annotations

import re
from typing import Any

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork import _dump
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import SwrkCriu, criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

USERNS_EARLY = "userns-early"  # the feature criu/patches/0028 adds to `criu --version`


class EarlyFor(SwrkCriu):
    """The real backend, its CRIU told to check another task's namespaces before the freeze."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid

    async def call(self, req: Any, *, env: dict[str, str] | None = None, **kw: Any) -> Any:
        if env and "CRIU_USERNS_EARLY" in env:
            env = {**env, "CRIU_USERNS_EARLY": str(self.pid)}
        return await super().call(req, env=env, **kw)


def checks(snap: Snapshot) -> list[str]:
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    return re.findall(r"userns: namespaces of \d+ (checked before the freeze|checked frozen: .*)", log)


async def answers(snap: Snapshot) -> None:
    [copy] = await Workspace.from_snapshot(snap)
    try:
        assert (await copy.exec("cat /workspace/mark")).stdout == "kept\n"
        assert (await copy.exec("hostname")).exit_code == 0
    finally:
        await copy.aclose()


@pytest.fixture(autouse=True)
def _log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")
    assert USERNS_EARLY in criu_features(), "CRIU lacks criu/patches/0028: run criu/build.sh"


async def test_the_namespaces_are_checked_before_the_freeze(ws: Workspace) -> None:
    assert ws._core.spec.security.userns  # the default: a user namespace, so CRIU checks it
    await ws.write_file("/workspace/mark", "kept\n")
    async with await ws.snapshot() as snap:
        assert checks(snap) == ["checked before the freeze"]
        await answers(snap)


async def test_another_task_is_checked_frozen(ws: Workspace) -> None:
    await ws.write_file("/workspace/mark", "kept\n")
    core = ws._core
    assert core.cgroup is not None
    other = next(p for p in core.cgroup.pids() if p != core.pid)  # the agent: the same namespaces, another task
    async with await _dump.snapshot(ws._core, EarlyFor(other)) as snap:
        assert checks(snap) == ["checked frozen: the early check: another task"]
        await answers(snap)


async def test_without_the_ready_check_the_namespaces_are_checked_frozen(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_dump, "OVERLAP", False)  # CRIU starts after the drain: no ready check
    await ws.write_file("/workspace/mark", "kept\n")
    async with await ws.snapshot() as snap:
        assert checks(snap) == []
        await answers(snap)
