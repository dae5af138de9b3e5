"""The host side meets what a workspace leaves in its tree (issue 31, cases 2 and 3, and the hostile-content suite).

Every host-side tree operation (fork, snapshot and rollback, the cache's capture and restore, export and import, the
file tools, teardown, ``bunshin gc``) runs over a workspace holding every hostile tree of ``trees_guest.py`` at
once: symlinks to a host canary (absolute, relative far above the root, into /proc, dangling, loops), hard links
(to each other, to an image file), fifos, unix sockets, the device nodes the kernel lets it make, a 1 TiB sparse
file, names with newlines and invalid UTF-8, a tree deeper than PATH_MAX. Each (tree, operation) pair is an
attempt: it works with the tree's content unchanged (a fingerprint taken inside the workspace) or fails with a
clear ``BunshinError``; the host canary is never read into the workspace nor written; ``no_leaks`` checks nothing
is left. Each runs in a workspace and in a live fork of one (``where``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from bunshin_async import BunshinError, TransferError, Workspace
from bunshin_async._host import _paths
from bunshin_async._host._kernel import DEFAULT_DISK, mount_options
from bunshin_async._workspace import _gc
from bunshin_async.cache import ForkStateProvider
from bunshin_async.transfer import export_snapshot, import_snapshot

GUEST = (Path(__file__).parent / "trees_guest.py").read_bytes()
ROOT = "/workspace/h"
TREES = ("links", "hardlinks", "special", "sparse", "names", "deep")


class Canary:
    """A host directory and file the workspace's symlinks name by their host paths."""

    def __init__(self, base: Path) -> None:
        self.dir = base / "canary"
        self.dir.mkdir()
        (self.dir / "secret").write_text("host")
        self.state = self.read()

    def read(self) -> tuple[object, ...]:
        st = os.stat(self.dir / "secret")
        return sorted(os.listdir(self.dir)), (self.dir / "secret").read_text(), st.st_mtime_ns, st.st_nlink

    def assert_unchanged(self) -> None:
        assert self.read() == self.state, "the host canary changed"


@pytest.fixture
def canary(tmp_path: Path) -> Canary:
    return Canary(tmp_path)


async def build(ws: Workspace, canary: Canary, trees: tuple[str, ...] = TREES) -> dict[str, Any]:
    await ws.write_file("/workspace/trees_guest.py", GUEST)
    r = await ws.exec(["python3", "/workspace/trees_guest.py", "build", ROOT, str(canary.dir), *trees], timeout=120)
    assert r.exit_code == 0, r
    made: dict[str, Any] = json.loads(r.stdout)
    if "special" in made:  # what the boundary lets a workspace make: no device it could open
        assert made["special"]["null"] == made["special"]["sda"] == "EPERM", made
    return made


async def fingerprint(ws: Workspace, *, sockets: bool = True) -> dict[str, Any]:
    argv = ["python3", "/workspace/trees_guest.py", "print", ROOT] + ([] if sockets else ["--no-sockets"])
    r = await ws.exec(argv, timeout=120)
    assert r.exit_code == 0, r
    out: dict[str, Any] = json.loads(r.stdout)
    assert out["entries"] > 20 and out["whiteout"], out
    return out


@asynccontextmanager
async def hostile(where: str, canary: Canary, trees: tuple[str, ...] = TREES) -> AsyncIterator[Workspace]:
    """A workspace (or a live fork of one) holding the hostile trees."""
    async with Workspace() as ws:
        if where == "workspace":
            await build(ws, canary, trees)
            yield ws
            return
        (copy,) = await ws.fork()
        try:
            await build(copy, canary, trees)
            yield copy
        finally:
            await copy.aclose()


# ------------------------------------------------------------------------------------------------ operations


async def op_fork(ws: Workspace, canary: Canary) -> None:
    want = await fingerprint(ws)
    (copy,) = await ws.fork()
    try:
        assert await fingerprint(copy) == want
        (grandchild,) = await copy.fork()  # a fork of a fork reads the tree from a layer, not an upper dir
        try:
            assert await fingerprint(grandchild) == want
        finally:
            await grandchild.aclose()
    finally:
        await copy.aclose()


async def op_rollback(ws: Workspace, canary: Canary) -> None:
    want = await fingerprint(ws)
    async with await ws.snapshot() as snap:
        r = await ws.exec(f"rm -rf {ROOT} && echo changed > /etc/issue.net && mkdir -p {ROOT}/later")
        assert r.exit_code == 0, r
        await ws.rollback(snap)
    assert await fingerprint(ws) == want


async def op_cache(ws: Workspace, canary: Canary) -> None:
    want = await fingerprint(ws)
    states = ForkStateProvider()
    ref = await states.capture(ws)
    try:
        assert 0 < ref.size < DEFAULT_DISK  # the 1 TiB sparse file counts what it holds
        copy = await states.restore(ws, ref)
        try:
            assert await fingerprint(copy) == want
        finally:
            await copy.aclose()
    finally:
        await states.discard(ref)


async def _round_trip(ws: Workspace) -> tuple[int, Workspace]:
    async with await ws.snapshot() as snap:
        frames = [f async for f in export_snapshot(snap)]

    async def feed() -> AsyncIterator[bytes]:
        for f in frames:
            yield f

    imported, _stats = await import_snapshot(feed())
    async with imported:
        (copy,) = await Workspace.from_snapshot(imported)
    return sum(map(len, frames)), copy


async def op_transfer(ws: Workspace, canary: Canary) -> None:
    """Everything but the deep tree travels (sockets are not files: tar leaves them out); a tree deeper than PATH_MAX
    is refused at export with a ``TransferError`` naming it (GNU tar extracts by path names), before any frame."""
    assert (await ws.exec(f"rm -rf {ROOT}/deep")).exit_code == 0
    want = await fingerprint(ws, sockets=False)
    size, copy = await _round_trip(ws)
    try:
        assert size < 64 << 20  # the 1 TiB sparse file travels as its data
        assert await fingerprint(copy, sockets=False) == want
    finally:
        await copy.aclose()
    await build(ws, canary, ("deep",))
    with pytest.raises(TransferError, match="deeper than the 4096-byte PATH_MAX") as info:
        await _round_trip(ws)
    assert len(str(info.value)) < 1000  # the 4,800-byte path, elided


async def op_files(ws: Workspace, canary: Canary) -> None:
    """The file tools resolve inside the workspace: a symlink to a host path names nothing there."""
    for name in ("abs", "absdir/secret", "rel"):
        try:
            data = await ws.read_file(f"{ROOT}/links/{name}")
        except BunshinError:
            continue
        assert data != b"host", name
    for name in ("abs", "absdir/secret"):
        try:
            await ws.write_file(f"{ROOT}/links/{name}", "from the workspace")
        except BunshinError:
            pass
    assert len(await ws.list_dir(f"{ROOT}/names")) == 7
    deep = "/".join([ROOT, "deep", *["a" * 15] * 300, "leaf"])
    try:
        assert await ws.read_file(deep) == b"at the bottom"
    except BunshinError:
        pass


async def op_teardown(ws: Workspace, canary: Canary) -> None:
    d = ws.directory
    await ws.aclose()
    assert not d.exists()


OPS: dict[str, Callable[[Workspace, Canary], Awaitable[None]]] = {
    "fork": op_fork,
    "rollback": op_rollback,
    "cache": op_cache,
    "transfer": op_transfer,
    "files": op_files,
    "teardown": op_teardown,
}


@pytest.mark.parametrize("op", OPS)
async def test_hostile_trees_meet_host_operations(where: str, op: str, canary: Canary) -> None:
    async with hostile(where, canary) as ws:
        await OPS[op](ws, canary)
        canary.assert_unchanged()
        if not ws.closed:
            assert (await ws.exec("echo alive")).stdout == "alive\n"
    canary.assert_unchanged()


_OWNER = """
import anyio, os, signal, subprocess, sys
from bunshin_async import Workspace
async def main():
    ws = Workspace()
    await ws.start()
    if sys.argv[1] == "fork":
        (ws,) = await ws.fork()
    await ws.write_file("/workspace/trees_guest.py", open(sys.argv[2], "rb").read())
    r = await ws.exec(["python3", "/workspace/trees_guest.py", "build", "/workspace/h", sys.argv[3]])
    assert r.exit_code == 0, r
    print(ws.id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
anyio.run(main)
"""


async def test_gc_removes_hostile_trees_of_a_dead_owner(where: str, canary: Canary, tmp_path: Path) -> None:
    """A process killed with a hostile workspace (and its tmpfs disk) mounted: ``bunshin gc`` removes it all."""
    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    guest = Path(__file__).parent / "trees_guest.py"
    proc = subprocess.run(
        [sys.executable, str(script), where, str(guest), str(canary.dir)], capture_output=True, text=True, timeout=120
    )
    ws_id = proc.stdout.strip()
    assert ws_id and (_paths.workspaces_dir() / ws_id / "upper/workspace/h/deep").is_dir(), proc.stderr[-2000:]
    lines = _gc.collect()
    assert f"removed {ws_id}" in lines, lines
    assert not (_paths.workspaces_dir() / ws_id).exists()
    canary.assert_unchanged()


# ------------------------------------------------------------------------------------------------ issue 31, 2 and 3


DOWN = f"cd deep && for i in $(seq 300); do cd {'a' * 15} || exit 1; done"


async def test_a_tree_deeper_than_path_max_forks(where: str) -> None:
    """Case 3: a legal tree deeper than PATH_MAX no longer makes its workspace unforkable."""
    async with Workspace() as ws:
        parent: Workspace | None = None
        if where == "fork":
            parent, (ws,) = ws, await ws.fork()
        try:
            # the command, then a file at the bottom (bash's cd takes one step at a time past PATH_MAX)
            r = await ws.exec(f"d=deep; for i in $(seq 300); do d=$d/{'a' * 15}; done; mkdir -p $d && {DOWN} "
                              "&& echo bottom > leaf")  # fmt: skip
            assert r.exit_code == 0, r
            (copy,) = await ws.fork()
            try:
                r = await copy.exec(f"{DOWN} && cat leaf")
                assert r.stdout == "bottom\n", r
            finally:
                await copy.aclose()
        finally:
            if parent is not None:
                await ws.aclose()
                await parent.aclose()


async def test_a_default_workspace_cannot_fill_the_host_disk(where: str) -> None:
    """Case 2: ``dd`` past the default bound fails inside with ENOSPC; the host's disk does not fill; deleting the file
    frees the workspace's disk again."""
    host = _paths.workspaces_dir()
    async with Workspace() as ws:
        parent: Workspace | None = None
        if where == "fork":
            parent, (ws,) = ws, await ws.fork()
        try:
            assert ws.limits.disk == DEFAULT_DISK
            upper = ws.directory / "upper"
            assert mount_options(upper) is not None and mount_options(upper)[0] == "tmpfs"  # type: ignore[index]
            free = os.statvfs(host).f_bavail * os.statvfs(host).f_frsize
            mib = (DEFAULT_DISK >> 20) + 64
            r = await ws.exec(f"dd if=/dev/zero of=/var/tmp/fill bs=1M count={mib} 2>&1; echo rc=$?", timeout=120)
            assert "No space left on device" in r.stdout and "rc=1" in r.stdout, r
            size = int((await ws.exec("stat -c %s /var/tmp/fill")).stdout)
            assert DEFAULT_DISK - (64 << 20) < size <= DEFAULT_DISK
            assert (
                ws._core.cgroup is not None and ws._core.cgroup.memory_dir is not None
            )  # its pages are the workspace's memory
            assert int((ws._core.cgroup.memory_dir / "memory.usage_in_bytes").read_text()) >= size
            now = os.statvfs(host).f_bavail * os.statvfs(host).f_frsize
            assert free - now < DEFAULT_DISK // 2, "the host's disk took the workspace's writes"
            r = await ws.exec("rm /var/tmp/fill && echo ok > /workspace/after && cat /workspace/after")
            assert r.stdout == "ok\n", r
        finally:
            if parent is not None:
                await ws.aclose()
                await parent.aclose()
