"""A dump's CRIU does not wait with the tree frozen for the SDK's answer to ``query-ext-files``
(``CRIU_EXT_FILES_LATER``, criu/patches/0032, issue 39): the SDK answers it with nothing, and the round trip to its
event loop was 0.2-1 ms of the freeze. CRIU reads that answer before its next message (``post-dump``); a failure in
the SDK's handler then fails the dump at ``post-dump``, where CRIU waits, and the workspace runs on. Checked by
CRIU's log (level 3), the order of the SDK's notifications and the copies' answers, never by timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bunshin_async import Config, ForkError, Workspace
from bunshin_async._fork import _dump
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host import _pidns
from bunshin_async._host._criu import SwrkCriu, criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

EXT_FILES_LATER = "ext-files-later"  # the feature criu/patches/0032 adds to `criu --version`


@pytest.fixture(autouse=True)
def _level3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")
    assert EXT_FILES_LATER in criu_features(), "CRIU lacks criu/patches/0032: run criu/build.sh"


class Spawns(SwrkCriu):
    """The real backend, noting each CRIU it starts and the notifications the SDK's handler gets."""

    def __init__(self, *, later: bool = True) -> None:
        super().__init__(on_spawn=self._spawned)
        self.later = later
        self.pids: list[int] = []
        self.names: list[str] = []

    async def _spawned(self, pid: int) -> None:
        self.pids.append(pid)

    async def call(self, req: Any, *, env: dict[str, str] | None = None, notify: Any = None, **kw: Any) -> Any:
        if env and not self.later:
            env = {k: v for k, v in env.items() if k != "CRIU_EXT_FILES_LATER"}

        async def noted(name: str, pid: int) -> None:
            self.names.append(name)
            await notify(name, pid)

        return await super().call(req, env=env, notify=noted if notify is not None else None, **kw)


def _lines(snap: Any) -> list[str]:
    return (record_of(snap).images / "dump.log").read_text(errors="replace").splitlines()


def _first(lines: list[str], text: str) -> int:
    return next(i for i, line in enumerate(lines) if text in line)


def _snapshots() -> list[Path]:
    store = Config.current().snapshot_dir
    return sorted(p for p in store.iterdir() if not p.name.startswith(".")) if store.exists() else []


async def test_the_answer_is_read_before_post_dump(ws: Workspace) -> None:
    await ws.write_file("/workspace/mark", "kept\n")
    backend = Spawns()
    async with await _dump.snapshot(ws._core, backend) as snap:
        assert backend.names[-2:] == ["query-ext-files", "post-dump"]
        lines = _lines(snap)
        later = _first(lines, "RPC NOTIFY query-ext-files: answer read later")
        read = _first(lines, "RPC NOTIFY query-ext-files: answer read, nothing to add")
        # sent before any task is dumped, read once every task is, before the thaw
        assert later < _first(lines, "Dumping task (pid") < read < _first(lines, "Unfreezing tasks"), lines[later:read]
        assert read > max(i for i, line in enumerate(lines) if "Dumping core (pid" in line)
        [copy] = await Workspace.from_snapshot(snap)
        try:
            assert (await copy.exec("cat /workspace/mark")).stdout == "kept\n"
        finally:
            await copy.aclose()


async def test_without_the_variable_criu_waits_for_the_answer(ws: Workspace) -> None:
    await ws.write_file("/workspace/mark", "kept\n")
    async with await _dump.snapshot(ws._core, Spawns(later=False)) as snap:
        log = "\n".join(_lines(snap))
        assert "answer read later" not in log and "RPC NOTIFY query-ext-files: no `opts` returned" in log
        [copy] = await Workspace.from_snapshot(snap)
        try:
            assert (await copy.exec("cat /workspace/mark")).stdout == "kept\n"
        finally:
            await copy.aclose()


async def test_a_failed_handler_fails_the_dump_at_post_dump(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    def ask(self: Any) -> None:
        raise OSError("injected at query-ext-files")

    monkeypatch.setattr(_pidns.LastPid, "ask", ask)
    backend = Spawns()
    before = _snapshots()
    with pytest.raises(ForkError, match="injected at query-ext-files"):
        await _dump.snapshot(ws._core, backend)
    # CRIU went on dumping (the answer is read later) and the failure came at post-dump, where CRIU waits
    assert backend.names[-2:] == ["query-ext-files", "post-dump"], backend.names
    assert not Path(f"/proc/{backend.pids[-1]}").exists()
    assert _snapshots() == before
    monkeypatch.undo()
    assert (await ws.exec("echo alive")).stdout == "alive\n"
    async with await ws.snapshot():  # the next dump is unaffected
        pass
