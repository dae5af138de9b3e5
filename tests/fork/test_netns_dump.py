"""A workspace's plain net namespace is left out of the images (``_dump.plain_netns``: each copy gets a fresh one), so
CRIU writes its image, one entry naming the external key, in place: no child enters the namespace and no sysfs is
mounted in it while the tree is frozen (criu/patches/0017, docs/concepts/fork-pause.md). CRIU's log says which it
did; a copy still answers on its restored loopback listener, and a namespace that is not plain is still dumped in
full by a child. Log lines and answers, never timings."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from bunshin_async import Security, Snapshot, Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import criu_features

from .test_gaps import ADD_ADDR

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

IN_PLACE = "ext-netns-in-place"  # the feature criu/patches/0017 adds to `criu --version`
LISTENER = (
    "import socket, time\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', 8099))\n"
    "s.listen()\n"
    "open('/workspace/listening', 'w').close()\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.sendall(b'here')\n"
    "    c.close()\n"
)
ASK = "import socket; c = socket.create_connection(('127.0.0.1', 8099), timeout=10); print(c.recv(4).decode())"


@pytest.fixture
async def listening(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workspace]:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")  # CRIU logs how it dumped each namespace
    assert IN_PLACE in criu_features(), "CRIU lacks criu/patches/0017: run criu/build.sh"
    # NET_ADMIN: the second test gives loopback an address of its own
    async with Workspace(security=Security(capabilities=("NET_ADMIN",))) as w:
        await w.write_file("/workspace/listener.py", LISTENER)
        await w.spawn(["python3", "/workspace/listener.py"])
        assert (await w.exec("while [ ! -e /workspace/listening ]; do sleep 0.02; done", timeout=30)).exit_code == 0
        yield w


def net_dumps(snap: Snapshot) -> list[str]:
    """How the snapshot's dump wrote each net namespace (CRIU's log)."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    return re.findall(r"Dump NET namespace info \d+(.*)", log)


async def answer(snap: Snapshot) -> str:
    [copy] = await Workspace.from_snapshot(snap)
    try:
        r = await copy.exec(["python3", "-c", ASK], timeout=30)
        return r.stdout.strip() or r.stderr
    finally:
        await copy.aclose()


async def test_a_plain_net_namespace_is_written_in_place(listening: Workspace) -> None:
    async with await listening.snapshot() as s1:
        assert net_dumps(s1) == [": external (bunshin-net), written in place"]
        assert await answer(s1) == "here"


async def test_a_configured_net_namespace_is_still_dumped_by_a_child(listening: Workspace) -> None:
    # an address of its own makes the namespace configuration the copy must carry (not plain: no external key)
    r = await listening.exec(["python3", "-c", ADD_ADDR])
    assert r.exit_code == 0, r.stderr
    async with await listening.snapshot() as s1:
        [how] = net_dumps(s1)
        assert re.fullmatch(r" via \d+", how), how
        assert await answer(s1) == "here"
