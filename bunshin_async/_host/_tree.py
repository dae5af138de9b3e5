"""Host-side copy, removal and walk of trees a workspace controls (its upper dir, a snapshot's layer, an imported
stage), going from directory descriptors only.

Everything in such a tree was made by a hostile program, so nothing here looks a path up by name below the tree's
root: each step is an ``openat(O_NOFOLLOW | O_DIRECTORY)`` from its parent's descriptor, an
``fstatat(AT_SYMLINK_NOFOLLOW)``, ``mkdirat``/``symlinkat``/``mknodat``/``linkat``. A symlink is copied as a
symlink (its target verbatim) and never followed, so one that names a host path reads or writes nothing there.
Fifos, sockets and device nodes (overlayfs whiteouts are 0:0 character devices) are made again with ``mknodat``,
never opened. A regular file is opened ``O_NOFOLLOW | O_NONBLOCK`` and checked to be the inode that was listed.

No limit on depth or path length beyond the kernel's 255 bytes per name (a workspace may legally build trees
deeper than PATH_MAX), and no recursion: the walk keeps a stack of levels, holding descriptors for the top
``FD_DEPTH`` levels only; deeper, it climbs back through ``..`` and checks (st_dev, st_ino) that it reached the
directory it left. Names are ``str`` with surrogate escapes (``os.fsencode`` gives the bytes back), so newlines
and invalid UTF-8 round-trip byte for byte.

A copy keeps what ``cp -a`` keeps: owners, modes, times, extended attributes (overlayfs's
``trusted.overlay.opaque``, file capabilities: set after the chown, which drops them), hard links among regular
files of the tree (up to ``LINKS_MAX`` inodes at a time; past that, further links are separate copies), and holes:
data runs found with ``SEEK_DATA``/``SEEK_HOLE`` are copied with ``copy_file_range(2)`` (``sendfile(2)`` across
filesystems), so a 1 TiB sparse file costs what it holds. Errors are ``OSError``; callers translate them.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

__all__ = ["FD_DEPTH", "LINKS_MAX", "Copied", "Entry", "copy_tree", "discard", "remove_tree", "walk"]

FD_DEPTH = 32
"""Levels of a walk that keep their directory descriptors open (two per level for a copy); deeper ones are reopened
through ``..`` when the walk climbs back. A copy holds at most 2 * FD_DEPTH + LINKS_MAX + 2 descriptors, whatever
the tree (a host's soft RLIMIT_NOFILE may be 1024)."""

LINKS_MAX = 128
"""Multiply-linked files of a copy whose first copy is held open to link the next ones to (past it, further links
of a new inode are separate copies)."""

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 30


class Copied(NamedTuple):
    """What ``copy_tree`` made: ``entries`` copied (the top directory not counted) and the ``bytes`` the copy holds
    (st_blocks of its files and symlinks, a hard-linked file once, directories not counted), tallied as it goes, so
    that nobody walks the copy again to size it."""

    entries: int
    bytes: int


def _listing(fd: int) -> list[str]:
    with os.scandir(fd) as it:  # scandir(fd) reads a dup of fd
        return [e.name for e in it]


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _changed(what: str) -> OSError:
    return OSError(errno.ESTALE, f"{what} changed while it was walked")


class _Level:
    """One directory of a walk: its descriptors (-1 when parked), their identities, the names left to visit."""

    __slots__ = ("fds", "ids", "names", "name", "st")

    def __init__(self, fds: list[int], name: str, st: os.stat_result) -> None:
        self.fds = fds
        self.ids = [_ident(os.fstat(fd)) for fd in fds]
        self.names = _listing(fds[0])
        self.names.reverse()  # popped from the end: visited in listing order
        self.name = name
        self.st = st


def _level(fd: int, name: str, st: os.stat_result | None) -> _Level:
    """A one-descriptor level taking ``fd`` (closed if the level cannot be made)."""
    try:
        return _Level([fd], name, st if st is not None else os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise


class _Stack:
    """The levels of a walk from the root to the current directory, with at most ``FD_DEPTH`` of them holding
    descriptors."""

    def __init__(self, root: _Level) -> None:
        self.levels = [root]

    def push(self, level: _Level) -> None:
        if len(self.levels) >= FD_DEPTH:
            parked = self.levels[-FD_DEPTH]
            for fd in parked.fds:
                if fd >= 0:
                    os.close(fd)
            parked.fds = [-1] * len(parked.fds)
        self.levels.append(level)

    def pop(self) -> _Level:
        """Leave the current level (its descriptors closed by the caller) and make sure its parent holds its own."""
        done = self.levels.pop()
        if self.levels and self.levels[-1].fds[0] < 0:
            parent = self.levels[-1]
            fds: list[int] = []
            try:
                for fd, want in zip(done.fds, parent.ids, strict=True):
                    up = os.open("..", _DIR, dir_fd=fd)
                    fds.append(up)
                    if _ident(os.fstat(up)) != want:
                        raise _changed("a directory")
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            parent.fds = fds
        return done

    def close(self) -> None:
        for level in self.levels:
            for fd in level.fds:
                if fd >= 0:
                    os.close(fd)
        self.levels.clear()


# ---------------------------------------------------------------------------------------------------- copy


def copy_tree(src: str | Path, dst: str | Path) -> Copied:
    """Copy the directory ``src`` to ``dst`` (which must not exist; its parent must), as ``cp -a`` would, from
    descriptors (module doc; blocking). Returns how many entries were copied and the bytes the copy holds. On
    failure ``dst`` is removed and the ``OSError`` raised."""
    sfd = os.open(src, _DIR)
    try:
        top = os.fstat(sfd)
        os.mkdir(dst, 0o700)
        try:
            dfd = os.open(dst, _DIR)
        except BaseException:
            os.rmdir(dst)
            raise
    except BaseException:
        os.close(sfd)
        raise
    try:
        _copy_xattrs(sfd, dfd)
        return _Copy(_Level([sfd, dfd], "", top)).run()
    except BaseException:
        remove_tree(dst, ignore_errors=True)
        raise


class _Copy:
    def __init__(self, root: _Level) -> None:
        self.stack = _Stack(root)
        self.links: dict[tuple[int, int], list[int]] = {}  # (dev, ino) in src -> [fd of the copy, links left]
        self.count = 0
        self.bytes = 0  # what the copy holds (``Copied``)
        self.cross = False  # copy_file_range refused these two filesystems: sendfile from now on

    def run(self) -> Copied:
        stack = self.stack
        try:
            while stack.levels:
                lv = stack.levels[-1]
                if not lv.names:
                    _set_meta(lv.fds[1], lv.st)
                    done = stack.pop()
                    os.close(done.fds[0])
                    os.close(done.fds[1])
                    continue
                name = lv.names.pop()
                s, d = lv.fds
                st = os.stat(name, dir_fd=s, follow_symlinks=False)
                self.count += 1
                if stat.S_ISDIR(st.st_mode):
                    stack.push(self._dir(s, d, name, st))
                elif stat.S_ISREG(st.st_mode):
                    self._file(s, d, name, st)
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(name, dir_fd=s), name, dir_fd=d)
                    self.bytes += os.stat(name, dir_fd=d, follow_symlinks=False).st_blocks * 512
                    os.chown(name, st.st_uid, st.st_gid, dir_fd=d, follow_symlinks=False)
                    _copy_xattrs_at(s, d, name)
                    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d, follow_symlinks=False)
                else:  # whiteouts (0:0 character devices), other devices, fifos, sockets: made, never opened
                    os.mknod(name, stat.S_IFMT(st.st_mode) | 0o600, st.st_rdev, dir_fd=d)
                    os.chown(name, st.st_uid, st.st_gid, dir_fd=d, follow_symlinks=False)
                    os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=d)  # our own new node, in our own tree
                    _copy_xattrs_at(s, d, name)
                    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d, follow_symlinks=False)
        finally:
            stack.close()
            for fd, _left in self.links.values():
                os.close(fd)
            self.links.clear()
        return Copied(self.count, self.bytes)

    def _dir(self, s: int, d: int, name: str, st: os.stat_result) -> _Level:
        os.mkdir(name, 0o700, dir_fd=d)
        sfd = os.open(name, _DIR, dir_fd=s)
        try:
            got = os.fstat(sfd)
            if _ident(got) != _ident(st):
                raise _changed(f"directory {name!r}")
            dfd = os.open(name, _DIR, dir_fd=d)
        except BaseException:
            os.close(sfd)
            raise
        try:
            _copy_xattrs(sfd, dfd)
            return _Level([sfd, dfd], name, got)
        except BaseException:
            os.close(sfd)
            os.close(dfd)
            raise

    def _file(self, s: int, d: int, name: str, st: os.stat_result) -> None:
        key = _ident(st)
        if st.st_nlink > 1 and key in self.links:
            held = self.links[key]
            os.link(f"/proc/self/fd/{held[0]}", name, dst_dir_fd=d, follow_symlinks=True)  # linkat(2)'s O_TMPFILE idiom
            held[1] -= 1
            if held[1] <= 0:
                os.close(held[0])
                del self.links[key]
            return
        fi = os.open(name, _FILE, dir_fd=s)
        try:
            got = os.fstat(fi)
            if not stat.S_ISREG(got.st_mode) or _ident(got) != key:
                raise _changed(f"file {name!r}")
            fo = os.open(name, _NEW, 0o600, dir_fd=d)
            try:
                if got.st_blocks * 512 >= got.st_size:  # no hole to keep: one run from 0, no seeks
                    self._dense(fi, fo, got.st_size)
                else:
                    self._data(fi, fo, got.st_size)
                os.fchown(fo, got.st_uid, got.st_gid)
                os.fchmod(fo, stat.S_IMODE(got.st_mode))  # after the chown, which clears set-id bits
                _copy_xattrs(fi, fo)  # after the chown, which drops security.capability
                os.utime(fo, ns=(got.st_atime_ns, got.st_mtime_ns))
                self.bytes += os.fstat(fo).st_blocks * 512  # a further link of it returns above, uncounted
                if got.st_nlink > 1 and len(self.links) < LINKS_MAX:
                    self.links[key] = [fo, got.st_nlink - 1]
                    fo = -1
            finally:
                if fo >= 0:
                    os.close(fo)
        finally:
            os.close(fi)

    def _dense(self, fi: int, fo: int, size: int) -> None:
        at = 0
        while at < size:
            n = self._range(fi, fo, at, min(size - at, _CHUNK), seek=False)
            if n == 0:  # the file shrank under us: the rest is a hole
                os.ftruncate(fo, size)
                return
            at += n

    def _data(self, fi: int, fo: int, size: int) -> None:
        """The data runs of ``fi`` into ``fo`` at the same offsets; holes stay holes."""
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fi, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole from here
                    break
                raise
            if start >= size:
                break
            end = min(os.lseek(fi, start, os.SEEK_HOLE), size)
            while start < end:
                n = self._range(fi, fo, start, min(end - start, _CHUNK))
                if n == 0:  # the file shrank under us: what is left stays a hole
                    end = size
                    break
                start += n
            pos = end
        os.ftruncate(fo, size)

    def _range(self, fi: int, fo: int, at: int, count: int, *, seek: bool = True) -> int:
        """Copy ``count`` bytes at ``at`` of ``fi`` to the same offset of ``fo``; ``seek=False``: ``fo``'s file
        position is ``at`` already (a dense copy from 0)."""
        if not self.cross:
            try:
                return os.copy_file_range(fi, fo, count, at, at)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                self.cross = seek = True  # copy_file_range never moved fo's file position
        if seek:
            os.lseek(fo, at, os.SEEK_SET)
        return os.sendfile(fo, fi, at, count)


def _set_meta(fd: int, st: os.stat_result) -> None:
    """Owner, then mode (a chown clears set-id bits), then times: a directory's, once its entries are made."""
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


_XATTR_SKIP = (errno.ENOTSUP, errno.EPERM)  # user.* is refused on symlinks and special files


def _copy_xattrs(s: int, d: int) -> None:
    try:
        names = os.listxattr(s)
    except OSError as exc:
        if exc.errno == errno.ENOTSUP:
            return
        raise
    for key in names:
        os.setxattr(d, key, os.getxattr(s, key))


def _copy_xattrs_at(s: int, d: int, name: str) -> None:
    """Extended attributes of an entry that cannot be opened (symlink, device, fifo, socket): through its
    directory's descriptor (``/proc/self/fd/N/name``, the last component not followed)."""
    src, dst = f"/proc/self/fd/{s}/{name}", f"/proc/self/fd/{d}/{name}"
    try:
        names = os.listxattr(src, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in _XATTR_SKIP:
            return
        raise
    for key in names:
        try:
            os.setxattr(dst, key, os.getxattr(src, key, follow_symlinks=False), follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in _XATTR_SKIP:
                raise


# ---------------------------------------------------------------------------------------------------- remove


def remove_tree(path: str | Path, *, ignore_errors: bool = False) -> None:
    """Remove ``path`` and everything below it, from descriptors (module doc; blocking). A missing ``path`` is no
    error. It never crosses into another filesystem mounted below (a mount point is an ``EXDEV`` error and stays,
    with what leads to it). ``ignore_errors``: remove what can be removed, raise nothing."""
    try:
        top = os.open(path, _DIR)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            if ignore_errors:
                return
            raise
        try:
            os.unlink(path)  # a file or symlink of that name: removed, not followed
        except OSError:
            if not ignore_errors:
                raise
        return
    first: OSError | None = None
    try:
        first = _remove_below(top)
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        first = first or exc
    if first is not None and not ignore_errors:
        raise first


def _remove_below(top: int) -> OSError | None:
    """Empty the directory ``top``; returns the first error met (the walk goes on past it)."""
    dev = os.fstat(top).st_dev
    stack = _Stack(_Level([os.dup(top)], "", os.fstat(top)))
    first: OSError | None = None
    try:
        while stack.levels:
            lv = stack.levels[-1]
            if not lv.names:
                done = stack.pop()
                os.close(done.fds[0])
                if stack.levels:
                    try:
                        os.rmdir(done.name, dir_fd=stack.levels[-1].fds[0])
                    except OSError as exc:
                        first = first or exc
                continue
            name = lv.names.pop()
            try:
                os.unlink(name, dir_fd=lv.fds[0])
                continue
            except FileNotFoundError:
                continue
            except IsADirectoryError:
                pass
            except OSError as exc:
                first = first or exc
                continue
            try:
                child = os.open(name, _DIR, dir_fd=lv.fds[0])
            except OSError as exc:
                first = first or exc
                continue
            st = os.fstat(child)
            if st.st_dev != dev:
                os.close(child)
                first = first or OSError(errno.EXDEV, f"{name!r} is a mount point: left in place")
                continue
            stack.push(_level(child, name, st))
    finally:
        stack.close()
    return first


def discard(path: str | Path) -> None:
    """``remove_tree(path, ignore_errors=True)``: for clean-up paths that must not fail (blocking)."""
    remove_tree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- walk


class Entry:
    """One entry of a ``walk``: ``dir_fd`` (its directory's descriptor), ``name``, ``st`` (its lstat) and
    ``parents()`` (the names of the directories between the walk's root and it). Valid until the next entry."""

    __slots__ = ("_levels", "dir_fd", "name", "st")

    def __init__(self, levels: list[_Level], dir_fd: int, name: str, st: os.stat_result) -> None:
        self._levels = levels
        self.dir_fd = dir_fd
        self.name = name
        self.st = st

    @property
    def depth(self) -> int:
        """0 for an entry of the root directory."""
        return len(self._levels) - 1

    def parents(self) -> tuple[str, ...]:
        return tuple(level.name for level in self._levels[1:])

    def shown(self, limit: int = 160) -> str:
        """The entry's path below the root for a message, its middle elided past ``limit`` characters (a hostile
        tree's paths have no length bound)."""
        text = "/".join([*self.parents(), self.name]) if self.depth < 64 else f"(depth {self.depth})/{self.name}"
        return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 2 :]}"


def walk(path: str | Path) -> Iterator[Entry]:
    """Every entry below the directory ``path``, parents before children (blocking; the module doc's rules). An
    entry removed or replaced while the walk goes is skipped (a live workspace's tree may change under it).
    Closing the iterator closes every descriptor."""
    top = os.open(path, _DIR)
    stack = _Stack(_level(top, "", None))
    try:
        while stack.levels:
            lv = stack.levels[-1]
            if not lv.names:
                os.close(stack.pop().fds[0])
                continue
            name = lv.names.pop()
            fd = lv.fds[0]
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield Entry(stack.levels, fd, name, st)
            if stat.S_ISDIR(st.st_mode):
                try:
                    child = os.open(name, _DIR, dir_fd=fd)
                except (FileNotFoundError, NotADirectoryError):  # gone or replaced since: skipped
                    continue
                except OSError as exc:
                    if exc.errno == errno.ELOOP:  # replaced by a symlink: never followed
                        continue
                    raise
                level = _level(child, name, st)
                if level.ids[0] != _ident(st):  # another directory moved in under that name
                    os.close(child)
                    continue
                stack.push(level)
    finally:
        stack.close()
