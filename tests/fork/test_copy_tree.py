"""``_snapstore.copy_tree`` (``bunshin_async._host._tree``, from descriptors) must give exactly what ``cp -a`` gives
(owners, modes, ns times, hard links, holes, symlinks, devices, overlay whiteouts, fifos, sockets and every xattr), from
the snapshot store's tmpfs to the workspaces' disk and back."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from bunshin_async._exceptions import ForkError
from bunshin_async._host import _snapstore

pytestmark = pytest.mark.fork_modes("criu-cow")  # no restore here: one mode is enough


def _make_tree(root: Path) -> None:
    root.mkdir()
    (root / "d" / "e").mkdir(parents=True)
    (root / "plain").write_bytes(b"hello\n")
    (root / "empty").touch()
    with open(root / "sparse", "wb") as f:  # data, a 4 MiB hole, data, a trailing hole
        f.write(b"a" * 5000)
        f.seek(4 << 20)
        f.write(b"b" * 100)
        f.truncate(12 << 20)
    os.link(root / "plain", root / "d" / "hard")
    os.symlink("../plain", root / "d" / "link")
    os.symlink("/nowhere", root / "dangling")
    os.mknod(root / "d" / "whiteout", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mkfifo(root / "fifo", 0o640)
    sk = socket.socket(socket.AF_UNIX)
    sk.bind(str(root / "d" / "sock"))
    sk.close()
    (root / "name with\nnewline").write_text("x")
    (root / "suid").write_text("#!/bin/sh\n")
    os.chown(root / "suid", 100000, 100001)
    os.chmod(root / "suid", 0o4755)
    os.setxattr(root / "d", "trusted.overlay.opaque", b"y")
    os.setxattr(root / "plain", "user.note", b"\x00\x01bin")
    os.setxattr(root / "d" / "link", "trusted.overlay.origin", b"\x00\xfbhandle", follow_symlinks=False)
    os.setxattr(root, "trusted.overlay.impure", b"y")
    os.chown(root / "d" / "link", 100000, 100000, follow_symlinks=False)
    os.chown(root / "d" / "e", 100005, 100005)
    os.chmod(root / "d" / "e", 0o500)  # read-only: filled before its mode is set
    for i, p in enumerate(sorted(root.rglob("*"), reverse=True)):
        os.utime(p, ns=(1_600_000_000_123_456_789 + i, 1_500_000_000_987_654_321 + i), follow_symlinks=False)
    os.utime(root, ns=(1_700_000_000_000_000_001, 1_700_000_000_000_000_002))


def _describe(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    inodes: dict[int, str] = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = os.lstat(p)
        rel = str(p.relative_to(root))
        xattrs = {n: os.getxattr(p, n, follow_symlinks=False) for n in os.listxattr(p, follow_symlinks=False)}
        data: object = None
        if stat.S_ISREG(st.st_mode):
            data = (p.read_bytes(), st.st_blocks)  # the blocks: holes stay holes
        elif stat.S_ISLNK(st.st_mode):
            data = os.readlink(p)
        first = inodes.setdefault(st.st_ino, rel) if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode) else None
        out[rel] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_rdev, st.st_mtime_ns, st.st_nlink, first, data,
                    sorted(xattrs.items()))  # fmt: skip
    return out


@pytest.mark.parametrize("direction", ["store-to-disk", "disk-to-store"])
async def test_copy_tree_is_cp_a(tmp_path: Path, direction: str) -> None:
    store = _snapstore.snapshot_dir() / f"copy-test-{os.getpid()}"
    store.mkdir(parents=True)
    try:
        src_base, dst_base = (store, tmp_path) if direction == "store-to-disk" else (tmp_path, store)
        src = src_base / "src"
        _make_tree(src)
        subprocess.run(["cp", "-a", "--", str(src), str(dst_base / "by-cp")], check=True)
        await _snapstore.copy_tree(src, dst_base / "in-process")
        want = _describe(dst_base / "by-cp")
        assert len(want) > 3 and want == _describe(dst_base / "in-process")
    finally:
        subprocess.run(["rm", "-rf", "--", str(store)], check=True)


async def test_copy_tree_failure(tmp_path: Path) -> None:
    """A failed copy is a ``ForkError`` naming both paths; a target it made is removed, one it did not is kept."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x")
    with pytest.raises(ForkError, match="copying .* failed"):
        await _snapstore.copy_tree(tmp_path / "src", tmp_path / "missing" / "dst")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep").write_text("y")
    with pytest.raises(ForkError, match="File exists"):
        await _snapstore.copy_tree(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst" / "keep").read_text() == "y"


async def test_a_finished_tree_copy_is_joined_without_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a dump's post-dump (the tree frozen) the upper dir's copy has usually finished: ``finish`` then costs no
    worker thread round trip; one still running is waited for in a worker (the loop is never blocked)."""
    _make_tree(tmp_path / "src")
    copy = _snapstore.TreeCopy(tmp_path / "src", tmp_path / "dst")
    copy.start()
    assert copy._thread is not None
    copy._thread.join()  # the copy has finished, as at a post-dump
    hops: list[object] = []
    real = anyio.to_thread.run_sync

    async def counted(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(func)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    await copy.finish()
    assert hops == []
    assert (tmp_path / "dst" / "plain").read_bytes() == b"hello\n"

    release = threading.Event()
    slow = _snapstore.TreeCopy(tmp_path / "src", tmp_path / "dst2")
    monkeypatch.setattr(slow, "_run", release.wait)  # a copy still running when finish is awaited
    slow.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(slow.finish)
        while not hops:  # finish went to a worker thread: this loop still runs
            await anyio.lowlevel.checkpoint()
        release.set()
    assert len(hops) == 1


async def test_a_prepared_tree_copy_copies_only_once_started(tmp_path: Path) -> None:
    """A dump makes the copy's thread before the freeze (``prepare``) and lets it go at query-ext-files (``start``);
    a dump that fails before that joins a thread that copied nothing, and a serial dump's ``finish`` copies itself."""
    _make_tree(tmp_path / "src")
    never = _snapstore.TreeCopy(tmp_path / "src", tmp_path / "never")
    never.prepare()
    assert never._thread is not None and never._thread.is_alive()  # idle, waiting for start
    await never.join()
    assert not never._thread.is_alive()
    assert not (tmp_path / "never").exists()

    started = _snapstore.TreeCopy(tmp_path / "src", tmp_path / "started")
    started.prepare()
    thread = started._thread
    started.start()
    assert started._thread is thread  # the prepared thread copies, no second one
    assert await started.finish() > 0
    assert (tmp_path / "started" / "plain").read_bytes() == b"hello\n"

    serial = _snapstore.TreeCopy(tmp_path / "src", tmp_path / "serial")
    serial.prepare()
    assert await serial.finish() > 0  # never started: copied by finish, the idle thread let go
    assert serial._thread is not None
    await serial.join()
    assert not serial._thread.is_alive()
    assert (tmp_path / "serial" / "plain").read_bytes() == b"hello\n"
