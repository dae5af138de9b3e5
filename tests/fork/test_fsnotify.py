"""fanotify and inotify watches survive a fork exactly (issue #20, item 3): the copy's listener has the same marks
(kind, flags, masks, ignore masks) on the same objects (found by device and inode number in its own view), and
it sees the events of changes made in the copy only, as the parent sees only its own. A mark whose ignore mask was
added with ``FAN_MARK_IGNORE`` (Linux 6.0) came back with its event mask turned into an ignore mask, or failed
the restore (criu/patches/0009). Both restore modes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from bunshin_async import Security, Workspace

HERE = Path(__file__).parent


@pytest.fixture
async def ws() -> AsyncIterator[Workspace]:
    # fanotify mount and filesystem marks need CAP_SYS_ADMIN of the host's user namespace (fanotify_init(2)): the
    # workspace under test is given it (explicit relaxations of the boundary: the capability, and no user
    # namespace, in which it would count for the workspace's own namespaces only), as the CRIU patches it checks
    # serve such workspaces.
    async with Workspace(security=Security(capabilities=("SYS_ADMIN",), userns=False)) as w:
        await w.write_file("/workspace/guest_state.py", (HERE / "guest_state.py").read_bytes())
        yield w


pytestmark = pytest.mark.fork_modes("criu-cow", "criu")


async def _marks(ws: Workspace) -> list[str]:
    await ws.exec("rm -f /tmp/marks && echo marks > /workspace/cmd")
    with anyio.fail_after(10):
        while (r := await ws.exec("cat /tmp/marks")).exit_code != 0:
            await anyio.sleep(0.02)
    return r.stdout.splitlines()


def _changes(tag: str) -> str:
    return (
        f"touch /workspace/dir/new-{tag}; echo {tag} >> /workspace/dir/file; echo {tag} > /workspace/fan-file;"
        f" echo {tag} >> /workspace/fan-ignore; chmod 644 /etc/hostname; touch /tmp/x-{tag}"
    )


def _expected(tag: str) -> list[str]:
    return [
        f"inotify /workspace/dir 0x100 new-{tag}",
        "inotify /workspace/dir/file 0x2 ",
        "inotify /workspace/dir/file 0x8 ",
        "inotify /etc/hostname 0x4 ",
        f"inotify /tmp 0x100 x-{tag}",
        "fanotify /workspace/fan-file 0xa",  # its inode mark (MODIFY | CLOSE_WRITE) and the mount and sb marks
        "fanotify /workspace/fan-ignore 0x8",  # CLOSE_WRITE only: MODIFY is ignored
    ]


async def _events(ws: Workspace) -> str:
    return (await ws.exec("cat /tmp/events.log")).stdout


async def test_watches_survive_fork_exactly(ws: Workspace) -> None:
    await ws.write_file("/workspace/watch_guest.py", (HERE / "watch_guest.py").read_bytes())
    watcher = await ws.spawn(["python3", "/workspace/watch_guest.py"], log_path="/workspace/watch.log")
    marks = await _marks(ws)
    assert "fanotify inode /workspace/fan-file mflags:0 mask:a ignored:20" in marks, marks
    assert "fanotify inode /workspace/fan-ignore mflags:440 mask:8 ignored:2" in marks, marks
    assert len(marks) == 9, marks  # 4 inotify watches, the group, 2 inode marks, a mount and a filesystem mark
    copies = await ws.fork(2)
    try:
        for copy in copies:
            assert await _marks(copy) == marks
        for copy in copies:  # nothing happened yet: no event anywhere
            assert "new-" not in await _events(copy)
        await copies[0].exec(_changes("c0"))
        await ws.exec(_changes("p"))
        with anyio.fail_after(10):
            for w, tag in ((copies[0], "c0"), (ws, "p")):
                while True:
                    seen = await _events(w)
                    if all(line in seen for line in _expected(tag)):
                        break
                    await anyio.sleep(0.05)
        # A misdirected event would be queued in the other's inotify instance while the change was made, so before
        # a later change of that instance's own: once each has logged its own later change, it has logged any.
        with anyio.fail_after(10):
            for w in (ws, *copies):
                await w.exec("touch /tmp/x-sync")
                while "x-sync" not in await _events(w):
                    await anyio.sleep(0.05)
        assert "-c0" not in await _events(ws) and "-p" not in await _events(copies[0])
        assert "new-" not in await _events(copies[1])
        for w in (ws, *copies):
            assert (await w.exec("cat /workspace/watch.log")).stdout == ""
            assert (await w.exec(f"kill -0 {watcher.pid}")).exit_code == 0
        assert "fanotify /workspace/fan-ignore 0xa" not in await _events(copies[0])
    finally:
        for copy in copies:
            await copy.aclose()
