"""A dump that failed because CRIU could not freeze the tree is taken again once (``_dump._snapshot``): the
instant a process spends between fork and exec does not come back; any other dump failure is not retried, and a
retry that fails the same way fails the fork, leaving nothing behind. The fault is injected by a backend that
answers a dump with CRIU's freeze error before running it; every other call is the real CRIU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bunshin_async import ForkError, Workspace
from bunshin_async._config import Config
from bunshin_async._host import _criu
from bunshin_async._host._criu import rpc

FREEZE = (
    "criu dump failed: Error (criu/cr-dump.c:1692): Timeout reached. Try to interrupt: 0\n"
    "Error (criu/seize.c:369): Unable to freeze cgroup /sys/fs/cgroup/freezer/x again after seizing a stopped task"
)
OTHER = "criu dump failed: Error (criu/files-reg.c:1): Can't dump something"


def failing(messages: list[str], calls: list[str]) -> type[_criu.SwrkCriu]:
    """A backend that fails the first ``len(messages)`` dumps with those messages, then runs CRIU."""

    class Failing(_criu.SwrkCriu):
        async def call(self, req: Any, **kw: Any) -> Any:
            kind = "dump" if req.type == rpc.DUMP else "other"
            calls.append(kind)
            if kind == "dump" and messages:
                raise ForkError(messages.pop(0), workspace_id=kw["workspace_id"])
            return await super().call(req, **kw)

    return Failing


def _snapshots() -> list[Path]:
    store = Config.current().snapshot_dir
    return sorted(p for p in store.iterdir() if not p.name.startswith(".")) if store.exists() else []


async def test_a_freeze_failure_is_retried_once_and_the_fork_works(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_criu, "default_backend", failing([FREEZE], calls))
    async with Workspace() as ws:
        await ws.write_file("/workspace/f", "kept")
        [copy] = await ws.fork(1)
        try:
            assert await copy.read_file("/workspace/f") == b"kept"
        finally:
            await copy.aclose()
    assert calls.count("dump") == 2


@pytest.mark.parametrize("messages", [[FREEZE, FREEZE], [OTHER]], ids=["freeze-twice", "other-error"])
async def test_other_failures_and_a_second_freeze_failure_fail_the_fork(
    monkeypatch: pytest.MonkeyPatch, messages: list[str]
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_criu, "default_backend", failing(list(messages), calls))
    async with Workspace() as ws:
        before = _snapshots()
        with pytest.raises(ForkError, match="criu dump failed"):
            await ws.fork(1)
        assert calls.count("dump") == len(messages)
        assert _snapshots() == before  # the failed attempts' snapshots are gone
        assert (await ws.exec("echo alive")).stdout == "alive\n"  # thawed, usable
