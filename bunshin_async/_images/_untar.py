"""Unpacking one untrusted image layer (a tar stream, maybe gzip) into a directory, in overlayfs form.

The archive is untrusted. Members are written by our own extraction (never ``TarFile.extract``): names are
relative and free of ``..``; every path is walked component by component with ``O_NOFOLLOW``, so nothing is ever
written through a symlink (a member below a symlink is an error, and symlinks themselves are stored verbatim and
never followed on the host); hard links must name a file extracted earlier in the same layer; device nodes are an
error outside ``/dev`` (whose image entries the agent layer's opaque ``/dev`` hides anyway, so they are dropped
there) and fifos are dropped; xattrs carried in the archive are ignored (an archive cannot plant
``trusted.overlay.*`` attributes); sizes are bounded (``ImportLimits``; a sparse file counts at its apparent size
and is written with holes). OCI whiteouts become overlayfs ones: ``.wh.NAME`` a 0/0 character device (or, when
the layer also carries NAME as a directory, an opaque NAME), ``.wh..wh..opq`` the ``trusted.overlay.opaque=y``
attribute on its directory (Documentation/filesystems/overlayfs.rst, "whiteouts and opaque directories").
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import stat
import tarfile
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, cast

import msgspec

CHUNK = 1 << 20
OPAQUE_XATTR = "trusted.overlay.opaque"


class ImportLimits(msgspec.Struct, frozen=True):
    """Bounds on what one import may unpack. Sizes are apparent sizes in bytes (a sparse file counts in full)."""

    max_layer_bytes: int = 8 << 30
    max_image_bytes: int = 32 << 30
    max_entries: int = 1_000_000
    max_metadata_bytes: int = 1 << 20  # a pax or GNU long-name header; a manifest, index or config document


class ImportCancelled(Exception):
    """Raised in the importing thread when its caller was cancelled."""


class Budget:
    """Apparent bytes left for the whole image (shared by its layers)."""

    def __init__(self, limits: ImportLimits) -> None:
        self.limits = limits
        self.used = 0


class HashingReader:
    """Counts and hashes what is read through it; refuses to read past ``cap`` bytes (a decompression bomb)."""

    def __init__(self, raw: IO[bytes], cap: int, cancel: threading.Event | None, hashing: bool = True) -> None:
        self.raw = raw
        self.cap = cap
        self.count = 0
        self.sha = hashlib.sha256()
        self.hashing = hashing
        self.cancel = cancel

    def read(self, n: int = -1) -> bytes:
        if self.cancel is not None and self.cancel.is_set():
            raise ImportCancelled()
        data = self.raw.read(n if n is not None and n >= 0 else CHUNK)
        self.count += len(data)
        if self.count > self.cap:
            raise LayerRejected(f"the layer's tar stream is larger than {self.cap} bytes")
        if self.hashing:
            self.sha.update(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


class LayerRejected(Exception):
    pass


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses oversized metadata headers before tarfile reads them into memory."""

    max_metadata = 1 << 20

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        meta = (
            tarfile.GNUTYPE_LONGNAME,
            tarfile.GNUTYPE_LONGLINK,
            tarfile.XHDTYPE,
            tarfile.XGLTYPE,
            tarfile.SOLARIS_XHDTYPE,
        )
        if self.type in meta and self.size > self.max_metadata:
            raise LayerRejected(f"a metadata header of {self.size} bytes (limit {self.max_metadata})")
        return super()._proc_member(tarfile_)  # type: ignore[misc, no-any-return]


def decompressed(head: bytes, blob: HashingReader) -> IO[bytes]:
    """The layer blob as a tar stream: gzip is unpacked, plain tar passed through; zstd is not supported here."""
    if head[:2] == b"\x1f\x8b":
        return cast(IO[bytes], gzip.GzipFile(fileobj=cast(IO[bytes], blob), mode="rb"))
    if head == b"\x28\xb5\x2f\xfd":
        raise LayerRejected("zstd-compressed layers are not supported (save the image uncompressed or with gzip)")
    return cast(IO[bytes], blob)


def _parts(name: str, what: str = "member") -> list[str]:
    if "\0" in name:
        raise LayerRejected(f"{what} name {name!r} holds a NUL byte")
    if name.startswith("/"):
        raise LayerRejected(f"{what} {name!r} is an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise LayerRejected(f"{what} {name!r} climbs out with '..'")
    return parts


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Dirs:
    """Directory fds of the layer being unpacked, by path (a bounded LRU; fds are borrowed, never closed by the
    caller), opened component by component with ``O_NOFOLLOW`` so no symlink is ever followed; missing ones are
    made 0755. A directory once made is never replaced within the layer (``_make_room`` refuses), so a cached fd
    stays the directory its path names."""

    def __init__(self, root_fd: int, size: int = 256) -> None:
        self.root_fd = root_fd
        self.size = size
        self.fds: OrderedDict[tuple[str, ...], int] = OrderedDict()

    def get(self, parts: list[str], create: bool, name: str) -> int:
        key = tuple(parts)
        k = len(key)
        while k and key[:k] not in self.fds:
            k -= 1
        fd = self.fds[key[:k]] if k else self.root_fd
        if k:
            self.fds.move_to_end(key[:k])
        for i in range(k, len(key)):
            part = key[i]
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise LayerRejected(f"{name!r}: {part!r} does not exist in the layer") from None
                os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file, or a symlink under O_NOFOLLOW
                    raise LayerRejected(
                        f"{name!r} goes through {part!r}, which is a symlink or a file in the layer"
                    ) from None
                raise
            self.fds[key[: i + 1]] = nfd
            fd = nfd
            if len(self.fds) > self.size:  # never the one just opened, nor its parent: both are the newest
                os.close(self.fds.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _make_room(name: str, dir_fd: int, member: str) -> None:
    """A later member replaces an earlier one of the same name (tar semantics), except a directory."""
    st = _lstat(name, dir_fd)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        raise LayerRejected(f"member {member!r} would replace a directory of the same layer")
    os.unlink(name, dir_fd=dir_fd)


def _set_meta(fd: int, m: tarfile.TarInfo) -> None:
    os.fchown(fd, m.uid, m.gid)
    os.fchmod(fd, m.mode & 0o7777)  # after chown, which clears setuid bits
    mtime = int(m.mtime) * 1_000_000_000
    os.utime(fd, ns=(mtime, mtime))


def extract_layer(
    stream: IO[bytes], root: Path, limits: ImportLimits, budget: Budget, cancel: threading.Event | None = None
) -> tuple[str, int, int]:
    """Unpack one tar layer into the empty directory ``root``. Returns (diff_id, apparent bytes, entries).
    Raises ``LayerRejected`` on a hostile or malformed archive (the caller deletes ``root``)."""
    cap = limits.max_layer_bytes + 2048 * limits.max_entries + (64 << 20)
    reader = HashingReader(stream, cap, cancel)
    root_fd = os.open(root, _DIR_FLAGS)
    fds = _Dirs(root_fd)
    size = entries = 0
    dirs: dict[tuple[str, ...], tarfile.TarInfo] = {}
    whiteouts: list[list[str]] = []
    opaque: list[list[str]] = []
    tinfo = type("_Bounded", (_BoundedTarInfo,), {"max_metadata": limits.max_metadata_bytes})
    try:
        try:
            tf = tarfile.open(fileobj=reader, mode="r|", tarinfo=tinfo)  # type: ignore[call-overload]
        except tarfile.ReadError as exc:
            raise LayerRejected(f"not a tar archive: {exc}") from None
        with tf:
            for m in _members(tf):
                entries += 1
                if entries > limits.max_entries:
                    raise LayerRejected(f"more than {limits.max_entries} entries")
                parts = _parts(m.name)
                if not parts:  # the layer's root itself
                    continue
                base = parts[-1]
                if base.startswith(".wh."):
                    if base == ".wh..wh..opq":
                        opaque.append(parts[:-1])
                    elif not base.startswith(".wh..wh."):  # other .wh..wh.* names are aufs bookkeeping
                        target = base[len(".wh.") :]
                        if target in ("", ".", ".."):
                            raise LayerRejected(f"whiteout {m.name!r} names nothing")
                        whiteouts.append([*parts[:-1], target])
                    continue
                if m.isdev():
                    if m.ischr() or m.isblk():
                        if parts[0] == "dev":
                            continue
                        raise LayerRejected(f"device node {m.name!r} (only /dev may hold them, and they are dropped)")
                    continue  # a fifo: nothing in a workspace needs one from the image
                if m.isreg():
                    size += m.size
                    budget.used += m.size
                    if size > limits.max_layer_bytes:
                        raise LayerRejected(
                            f"{m.name!r} takes the layer past {limits.max_layer_bytes} bytes ({size} so far)"
                        )
                    if budget.used > limits.max_image_bytes:
                        raise LayerRejected(f"{m.name!r} takes the image past {limits.max_image_bytes} bytes")
                pfd = fds.get(parts[:-1], True, m.name)
                _write_member(tf, m, base, pfd, fds, dirs, parts)
            reader.drain()  # the tar's trailing zero blocks count in the diff_id
        for parts in opaque:
            os.setxattr(fds.get(parts, True, "/".join(parts) + "/.wh..wh..opq"), OPAQUE_XATTR, b"y")
        for parts in whiteouts:
            pfd = fds.get(parts[:-1], True, "/".join(parts))
            st = _lstat(parts[-1], pfd)
            if st is None:
                os.mknod(parts[-1], stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=pfd)
            elif stat.S_ISDIR(st.st_mode):  # deleted and made again in this layer: hide the lower one's files
                os.setxattr(fds.get(parts, False, "/".join(parts)), OPAQUE_XATTR, b"y")
        for dparts in sorted(dirs, key=len, reverse=True):  # deepest first: a child's mtime change is done
            _set_meta(fds.get(list(dparts), False, "/".join(dparts)), dirs[dparts])
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise LayerRejected(f"corrupt archive: {exc}") from None
    finally:
        fds.close()
        os.close(root_fd)
    return f"sha256:{reader.sha.hexdigest()}", size, entries


def _members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while True:
        m = tf.next()
        if m is None:
            return
        yield m


def _write_member(
    tf: tarfile.TarFile,
    m: tarfile.TarInfo,
    base: str,
    pfd: int,
    fds: _Dirs,
    dirs: dict[tuple[str, ...], tarfile.TarInfo],
    parts: list[str],
) -> None:
    # Names are created exclusively; only when one exists (a repeated member) is it looked at and replaced.
    if m.isdir():
        try:
            os.mkdir(base, 0o700, dir_fd=pfd)
        except FileExistsError:
            st = _lstat(base, pfd)
            if st is None or not stat.S_ISDIR(st.st_mode):
                _make_room(base, pfd, m.name)
                os.mkdir(base, 0o700, dir_fd=pfd)
        dirs[tuple(parts)] = m
        return
    if m.issym():
        if "\0" in m.linkname:
            raise LayerRejected(f"symlink {m.name!r} has a NUL byte in its target")
        try:
            os.symlink(m.linkname, base, dir_fd=pfd)  # stored verbatim; resolved only inside the workspace
        except FileExistsError:
            _make_room(base, pfd, m.name)
            os.symlink(m.linkname, base, dir_fd=pfd)
        os.chown(base, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
        mtime = int(m.mtime) * 1_000_000_000
        os.utime(base, ns=(mtime, mtime), dir_fd=pfd, follow_symlinks=False)
        return
    if m.islnk():
        tparts = _parts(m.linkname, "hard link target")
        if not tparts:
            raise LayerRejected(f"hard link {m.name!r} points at the layer's root")
        pfd = os.dup(pfd)  # opening the target's directory may evict the link's own from the cache
        try:
            tfd = fds.get(tparts[:-1], False, m.linkname)
            st = _lstat(tparts[-1], tfd)
            if st is None:
                raise LayerRejected(f"hard link {m.name!r} -> {m.linkname!r}: the target is not in the layer")
            if stat.S_ISDIR(st.st_mode):
                raise LayerRejected(f"hard link {m.name!r} -> {m.linkname!r} names a directory")
            _make_room(base, pfd, m.name)
            os.link(tparts[-1], base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(pfd)
        return
    if not m.isreg():
        raise LayerRejected(f"member {m.name!r} has an unsupported type {m.type!r}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(base, flags, 0o600, dir_fd=pfd)
    except FileExistsError:
        _make_room(base, pfd, m.name)
        fd = os.open(base, flags, 0o600, dir_fd=pfd)
    try:
        src = tf.extractfile(m)
        assert src is not None
        runs = cast("list[tuple[int, int]] | None", m.sparse)
        # Read the stored bytes straight from the stream (positioned at the member's data: tarfile skips to the
        # next header only at the next ``next()``); a sparse member stores its data runs back to back.
        data = cast(IO[bytes], tf.fileobj)
        for offset, length in runs if runs else [(0, m.size)]:
            left, pos = length, offset
            while left:
                chunk = data.read(min(CHUNK, left))
                if not chunk:
                    raise LayerRejected(f"{m.name!r} is truncated")
                os.pwrite(fd, chunk, pos)  # a sparse member's holes stay holes on disk
                pos += len(chunk)
                left -= len(chunk)
        if runs:
            os.ftruncate(fd, m.size)
        _set_meta(fd, m)
    finally:
        os.close(fd)
