"""A dump's CRIU sends the SDK only the notifications it handles (``CRIU_NOTIFY_ONLY``, criu/patches/0030, issue 39):
each is a round trip to the SDK's event loop, and ``network-lock`` and ``network-unlock`` came with the tree frozen
though the SDK skips the network lock and answers them with nothing, ``pre-dump`` inside the workspace's pause.
The notifications the SDK sees are counted; the copy is checked by its answers, never by timing."""

from __future__ import annotations

import re
from typing import Any

import pytest

from bunshin_async import Workspace
from bunshin_async._fork import _dump
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import NotifyHandler, SwrkCriu, criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

NOTIFY_ONLY = "notify-only"  # the feature criu/patches/0030 adds to `criu --version`


class Seen(SwrkCriu):
    """The real backend, noting the notifications the SDK's handler gets."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    async def call(self, req: Any, *, notify: NotifyHandler | None = None, **kw: Any) -> Any:
        async def noted(name: str, pid: int) -> None:
            self.names.append(name)
            if notify is not None:
                await notify(name, pid)

        return await super().call(req, notify=noted if notify is not None else None, **kw)


async def test_only_the_notifications_handled_are_sent(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")
    assert NOTIFY_ONLY in criu_features(), "CRIU lacks criu/patches/0030: run criu/build.sh"
    await ws.write_file("/workspace/mark", "kept\n")
    backend = Seen()
    async with await _dump.snapshot(ws._core, backend) as snap:
        assert backend.names[-2:] == ["query-ext-files", "post-dump"]  # a tracked first snapshot's pre-copy: none
        assert set(backend.names) == {"query-ext-files", "post-dump"}
        log = (record_of(snap).images / "dump.log").read_text(errors="replace")
        skipped = re.findall(r"RPC NOTIFY (\S+): not asked for", log)
        assert skipped == ["pre-dump", "network-lock", "network-unlock"], skipped
        [copy] = await Workspace.from_snapshot(snap)
        try:
            assert (await copy.exec("cat /workspace/mark")).stdout == "kept\n"
        finally:
            await copy.aclose()
