"""``_tree``: copy, removal and walk of hostile trees from descriptors (needs root for device nodes, trusted.*
xattrs and ownership; no workspace)."""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin_async import _native
from bunshin_async._host import _tree

DEEP = 300  # levels of 16 bytes: 4800 bytes of path, past PATH_MAX (4096) and FD_DEPTH
NAME = "d" * 15
ODD = os.fsdecode(b"new\nline \xff\xfe")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _deep(root: Path, levels: int, leaf: bytes = b"deep") -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir(NAME, dir_fd=fd)
            nfd = os.open(NAME, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        wfd = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(wfd, leaf)
        os.close(wfd)
    finally:
        os.close(fd)


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A tree a workspace could leave, and a host canary its symlinks point at."""
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "secret").write_text("host")
    src = tmp_path / "src"
    src.mkdir()
    (src / "file").write_text("hello")
    os.chown(src / "file", 100000, 100001)
    os.chmod(src / "file", 0o4755)
    os.link(src / "file", src / "hard")
    (src / "capped").write_bytes(b"\x7fELF")
    os.setxattr(src / "capped", "security.capability", bytes.fromhex("0100000200100000000000000000000000000000"))
    os.symlink(str(canary / "secret"), src / "abs")
    os.symlink(str(canary), src / "absdir")
    os.symlink("../../../" + str(canary), src / "rel")
    os.symlink("loop", src / "loop")
    os.symlink("nowhere", src / "dangling")
    os.mkfifo(src / "fifo")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(src / "sock"))
    os.mknod(src / "whiteout", stat.S_IFCHR | 0o600, 0)
    os.mknod(src / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    (src / "opaque").mkdir()
    os.setxattr(src / "opaque", "trusted.overlay.opaque", b"y")
    with open(src / "sparse", "wb") as f:
        f.truncate(1 << 40)
        f.seek(1 << 39)
        f.write(b"middle")
    (src / ODD).write_text("odd name")
    _deep(src, DEEP)
    yield src, canary
    for p in (src, tmp_path / "dst"):
        _tree.remove_tree(p, ignore_errors=True)


def _describe(root: Path) -> list[tuple[object, ...]]:
    """Everything ``cp -a`` keeps, per entry, in walk order (inode numbers as link groups)."""
    out: list[tuple[object, ...]] = []
    groups: dict[int, int] = {}
    for e in _tree.walk(root):
        dfd, name, st = e.dir_fd, e.name, e.st
        row: list[object] = [name, st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, st.st_rdev]
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            row.append(groups.setdefault(st.st_ino, len(groups)))
        if stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
            try:
                h = hashlib.sha256()
                pos = 0
                while True:
                    try:
                        pos = os.lseek(fd, pos, os.SEEK_DATA)
                    except OSError:
                        break
                    chunk = os.pread(fd, 1 << 16, pos)
                    h.update(pos.to_bytes(8, "little") + chunk)
                    pos += max(len(chunk), 1)
                row.append(h.hexdigest())
            finally:
                os.close(fd)
        if stat.S_ISLNK(st.st_mode):
            row.append(os.readlink(name, dir_fd=dfd))
        path = f"/proc/self/fd/{dfd}/{name}"
        keys = os.listxattr(path, follow_symlinks=False)
        row.append(sorted((k, os.getxattr(path, k, follow_symlinks=False)) for k in keys))
        out.append(tuple(row))
    return out


def test_copy_keeps_everything_and_follows_nothing(hostile: tuple[Path, Path], tmp_path: Path) -> None:
    src, canary = hostile
    before = _fds()
    n = _tree.copy_tree(src, tmp_path / "dst")
    assert _fds() == before
    want = _describe(src)
    assert n.entries == len(want) > DEEP
    walked = [e.st for e in _tree.walk(tmp_path / "dst") if not stat.S_ISDIR(e.st.st_mode)]
    held = {(st.st_dev, st.st_ino): st.st_blocks * 512 for st in walked}  # each inode once (the hard link)
    assert n.bytes == sum(held.values()) > 0  # tallied by the copy, no walk needed
    assert _describe(tmp_path / "dst") == want
    dst = tmp_path / "dst"
    assert os.stat(dst / "hard").st_ino == os.stat(dst / "file").st_ino
    assert os.stat(dst / "sparse").st_blocks * 512 < 1 << 20  # 1 TiB apparent, one page held
    assert os.getxattr(dst / "capped", "security.capability")  # survived the chown
    assert stat.S_IMODE(os.stat(dst / "file").st_mode) == 0o4755
    assert os.readlink(dst / "abs") == str(canary / "secret")
    assert sorted(os.listdir(canary)) == ["secret"] and (canary / "secret").read_text() == "host"


def test_remove_is_descriptor_relative_and_stays_on_its_filesystem(hostile: tuple[Path, Path]) -> None:
    src, canary = hostile
    inner = src / "mnt"
    inner.mkdir()
    _native.mount("bunshin-test", str(inner), "tmpfs", 0, "size=1m")
    try:
        (inner / "kept").write_text("other filesystem")
        before = _fds()
        with pytest.raises(OSError) as info:
            _tree.remove_tree(src)
        assert info.value.errno == errno.EXDEV
        assert _fds() == before
        assert (inner / "kept").read_text() == "other filesystem"
        assert sorted(os.listdir(src)) == ["mnt"]  # everything else went, the mount point stays
    finally:
        _native.umount2(str(inner), _native.MNT_DETACH)
    _tree.remove_tree(src)
    assert not src.exists()
    assert sorted(os.listdir(canary)) == ["secret"] and (canary / "secret").read_text() == "host"


def test_remove_of_a_symlink_or_nothing(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "x").write_text("x")
    os.symlink(target, tmp_path / "link")
    _tree.remove_tree(tmp_path / "link")  # the link goes, never what it names
    assert not os.path.lexists(tmp_path / "link") and (target / "x").exists()
    _tree.remove_tree(tmp_path / "missing")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of its own (a workspace's disk is one): a deep tree is quick to remove there."""
    fs = tmp_path / "fs"
    fs.mkdir()
    _native.mount("bunshin-test", str(fs), "tmpfs", 0, "size=256m")
    try:
        yield fs
    finally:
        _native.umount2(str(fs), _native.MNT_DETACH)


def test_walk_and_copy_of_a_tree_deeper_than_the_recursion_limit(tmpfs: Path) -> None:
    tmp_path = tmpfs
    src = tmp_path / "src"
    src.mkdir()
    _deep(src, 5000)
    try:
        assert sum(1 for _ in _tree.walk(src)) == 5001
        _tree.copy_tree(src, tmp_path / "dst")
        assert _describe(tmp_path / "dst")[-1][0] == "leaf"
    finally:
        _tree.remove_tree(src)
        _tree.remove_tree(tmp_path / "dst")
    assert os.listdir(tmp_path) == []


def test_a_failed_copy_leaves_nothing(hostile: tuple[Path, Path], tmp_path: Path) -> None:
    src, _canary = hostile
    small = tmp_path / "small"
    small.mkdir()
    _native.mount("bunshin-test", str(small), "tmpfs", 0, "size=64k,nr_inodes=64")
    try:
        before = _fds()
        with pytest.raises(OSError) as info:
            _tree.copy_tree(src, small / "dst")
        assert info.value.errno == errno.ENOSPC
        assert _fds() == before
        assert os.listdir(small) == []
    finally:
        _native.umount2(str(small), _native.MNT_DETACH)


def test_hard_links_past_the_held_ones_are_copies(tmpfs: Path) -> None:
    """Past ``LINKS_MAX`` pending inodes a further link is a separate copy of the same data (descriptors bounded)."""
    src = tmpfs / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    groups = _tree.LINKS_MAX + 40
    for i in range(groups):
        (src / "a" / f"f{i}").write_text(f"data {i}")
        os.link(src / "a" / f"f{i}", src / "b" / f"f{i}")
    before = _fds()
    _tree.copy_tree(src, tmpfs / "dst")
    assert _fds() == before
    dst = tmpfs / "dst"
    linked = sum(os.stat(dst / "a" / f"f{i}").st_ino == os.stat(dst / "b" / f"f{i}").st_ino for i in range(groups))
    assert linked == _tree.LINKS_MAX
    assert all((dst / d / f"f{i}").read_text() == f"data {i}" for d in "ab" for i in range(groups))
