"""The workspaces' user namespace: root inside is an unprivileged host uid/gid range, without idmapped mounts.

Every workspace (and every fork of one) gets its own user namespace with the same mapping, ``IdMap``: ids
``0..count-1`` inside are ``host_uid..host_uid+count-1`` (and the same for gids) on the host, as Docker's
``userns-remap`` does. Its mount, pid, ipc, uts and net namespaces are owned by it, so the capabilities the
workspace keeps are capabilities over those namespaces only; on the host its processes are the mapped uid.

CRIU 4.2.1 cannot restore idmapped mounts, so the read-only layers are not idmapped: each lower directory (an image
layer, the built-in image's rootfs, the agent layer) has a *shifted copy* beside it,
``<dir>.shift-<uid>-<gid>-<count>-<key>`` (``key``: the source's identity), whose owners are the source's plus the
range's base (an id beyond the range becomes the overflow id, nobody inside), made once on first use (``bunshin
image build`` makes those of the built-in images) and shared by every workspace with that mapping; ``bunshin gc``
removes copies whose source is gone or was replaced and that no workspace mounts (an image layer's go with the
layer). The overlay is mounted by the host (the shim and the restore wrapper mount it before the user namespace
exists), so overlayfs reads its ``trusted.overlay.*`` attributes and whiteouts with the host's credentials; the upper
and work dirs are owned by the mapped root. A ``from_dir`` image is taken as immutable: a new shifted copy is made
only when its top directory is replaced (or changes its entries).

Not carried over: POSIX ACLs naming ids (none in the built-in images); an image layer's setuid files keep their bit
and are setuid to the shifted owner, which is root inside and nothing outside.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import stat
from pathlib import Path

import msgspec

from .._exceptions import ImageError, InvalidValue
from . import _tree
from ._kernel import alive, owner_token, read_token

__all__ = ["DEFAULT_IDMAP", "IdMap", "shifted", "shifted_lower"]

OVERFLOW_ID = 65534
"""The kernel's overflow uid/gid (/proc/sys/kernel/overflowuid): what ``nobody`` is inside."""

_CAP_XATTR = "security.capability"
_VFS_CAP_REVISION_MASK = 0xFF000000
_VFS_CAP_REVISION_2 = 0x02000000
_VFS_CAP_REVISION_3 = 0x03000000


class IdMap(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One uid/gid range of the host: ``0..count-1`` inside is ``host_uid..`` / ``host_gid..`` outside."""

    host_uid: int = 100000
    host_gid: int = 100000
    count: int = 65536

    def __post_init__(self) -> None:
        if not (0 < self.host_uid and 0 < self.host_gid and OVERFLOW_ID < self.count):
            raise InvalidValue(
                f"bad id map {self}: the host ids must not be 0 and count must exceed {OVERFLOW_ID}", argument="idmap"
            )
        if max(self.host_uid, self.host_gid) + self.count > 1 << 32:
            raise InvalidValue(f"bad id map {self}: the range passes 2^32", argument="idmap")

    @property
    def suffix(self) -> str:
        return f".shift-{self.host_uid}-{self.host_gid}-{self.count}"

    def uid(self, inside: int) -> int:
        return self.host_uid + (inside if inside < self.count else OVERFLOW_ID)

    def gid(self, inside: int) -> int:
        return self.host_gid + (inside if inside < self.count else OVERFLOW_ID)

    def init_arg(self) -> str:
        """bunshin-init's ``--userns`` value (native/init.c)."""
        return f"{self.host_uid}:{self.host_gid}:{self.count}"


DEFAULT_IDMAP = IdMap()


def shifted_path(src: Path, idmap: IdMap = DEFAULT_IDMAP) -> Path:
    """Where the shifted copy of ``src`` as it is now lives: beside it, named by the range and by the identity of
    ``src`` (device, inode, ctime), so a replaced source gets a new copy and the old one stays while an overlay
    may still use it (``collect`` removes it later). Raises OSError for a missing source."""
    st = src.stat()
    key = hashlib.sha256(f"{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}".encode()).hexdigest()[:12]
    return src.with_name(f"{src.name}{idmap.suffix}-{key}")


SUFFIX_MAX = len(".shift-4294967295-4294967295-4294967296-") + 12
"""The most a shifted copy's name adds to its source's (for the overlay options' length)."""


def _shift_caps(value: bytes, rootid: int) -> bytes:
    """A file capability (vfs_cap_data) whose root is ``rootid``: a v2 one would count for host root only, and
    the kernel ignores it in a namespace whose root is not host root (capability.c, rootid_owns_currentns)."""
    if len(value) < 20:
        return value
    magic = int.from_bytes(value[:4], "little")
    if magic & _VFS_CAP_REVISION_MASK not in (_VFS_CAP_REVISION_2, _VFS_CAP_REVISION_3):
        return value
    magic = (magic & ~_VFS_CAP_REVISION_MASK) | _VFS_CAP_REVISION_3
    return magic.to_bytes(4, "little") + value[4:20] + rootid.to_bytes(4, "little")


def shift_tree(root: Path, idmap: IdMap) -> None:
    """Add the range's base to every owner under ``root``, in place (blocking). chown(2) clears setuid/setgid
    bits and file capabilities, so both are put back (capabilities rooted at the mapped root)."""
    seen: set[tuple[int, int]] = set()

    def one(path: str, st: os.stat_result) -> None:
        """``path``: the entry through its directory's descriptor (``/proc/self/fd/N/name``, not followed)."""
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            if (st.st_dev, st.st_ino) in seen:
                return
            seen.add((st.st_dev, st.st_ino))
        link = stat.S_ISLNK(st.st_mode)
        caps = None
        if stat.S_ISREG(st.st_mode):
            try:
                caps = os.getxattr(path, _CAP_XATTR, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.ENODATA, errno.ENOTSUP):
                    raise
        os.chown(path, idmap.uid(st.st_uid), idmap.gid(st.st_gid), follow_symlinks=False)
        if not link:
            os.chmod(path, stat.S_IMODE(st.st_mode))  # not a symlink: nothing to follow
        if caps is not None:
            os.setxattr(path, _CAP_XATTR, _shift_caps(caps, idmap.uid(0)), follow_symlinks=False)

    one(str(root), os.lstat(root))
    for e in _tree.walk(root):  # from descriptors: an image's tree may be deeper than PATH_MAX
        one(f"/proc/self/fd/{e.dir_fd}/{e.name}", e.st)


def shifted(src: Path, idmap: IdMap = DEFAULT_IDMAP) -> Path:
    """The shifted copy of the lower directory ``src`` (``shifted_path``), made now if missing (blocking). One
    process makes it while concurrent callers wait (a lock file beside it); a copy is complete once it has its
    name (renamed into place), and is never changed or moved afterwards."""
    try:
        dst = shifted_path(src, idmap)
    except OSError as exc:
        raise ImageError(f"layer {src} cannot be used: {exc.strerror}", image=str(src)) from exc
    if dst.is_dir():
        return dst
    lock = os.open(src.with_name(f".{dst.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dst.is_dir():
            return dst
        tmp = src.with_name(f".{dst.name}.tmp-{secrets.token_hex(4)}")
        owner = tmp.with_name(tmp.name + ".owner")
        owner.write_text(owner_token(os.getpid()))
        try:
            # as cp -a: hard links, sparse files, modes, times and xattrs (trusted.overlay.* included)
            try:
                _tree.copy_tree(src, tmp)
            except OSError as exc:
                raise ImageError(f"copying {src} for the user namespace failed: {exc}", image=str(src)) from exc
            shift_tree(tmp, idmap)
            tmp.rename(dst)
        finally:
            _tree.discard(tmp)
            owner.unlink(missing_ok=True)
    finally:
        os.close(lock)
    return dst


def shifted_lower(lower: str, idmap: IdMap = DEFAULT_IDMAP) -> str:
    """An overlay lowerdir chain with every layer replaced by its shifted copy (blocking)."""
    return ":".join(str(shifted(Path(d), idmap)) for d in lower.split(":"))


def lower_for(lower: str, userns: bool, *, create: bool = True) -> str:
    """``lower`` as a workspace with (``userns``) or without a user namespace mounts it; ``create=False`` only
    names the shifted copies (blocking)."""
    if not userns:
        return lower
    if create:
        return shifted_lower(lower)
    return ":".join(str(shifted_path(Path(d))) for d in lower.split(":"))


def chown_root(path: Path, idmap: IdMap = DEFAULT_IDMAP) -> None:
    """Make ``path`` owned by the mapped root (a fresh workspace's upper and work dirs)."""
    os.chown(path, idmap.uid(0), idmap.gid(0))


def collect(parents: list[Path], mounted: set[str]) -> list[str]:
    """Remove, under each directory of ``parents``, shifted copies that are not their source's current one (it was
    replaced or is gone) and that no overlay mounts, their lock files, and the partial copies of dead processes
    (blocking; ``bunshin gc``)."""
    out: list[str] = []
    for parent in parents:
        entries = sorted(parent.iterdir()) if parent.is_dir() else []
        for entry in entries:
            name = entry.name
            if ".shift-" not in name or name.endswith(".owner"):
                continue
            if name.startswith("."):
                if ".tmp-" in name:
                    owner = entry.with_name(name + ".owner")
                    token = read_token(owner) or ""
                    if token and alive(token):
                        continue
                    _tree.discard(entry)
                    owner.unlink(missing_ok=True)
                    out.append(f"removed partial shifted copy {entry}")
                elif name.endswith(".lock") and not entry.with_name(name[1 : -len(".lock")]).exists():
                    entry.unlink(missing_ok=True)
                continue
            src = entry.with_name(name.split(".shift-")[0])
            try:
                current = shifted_path(src, _idmap_of(name)) == entry
            except (OSError, ValueError):
                current = False
            if current:
                continue
            if str(entry) in mounted:
                out.append(f"kept stale shifted copy {entry} (mounted by a live workspace)")
                continue
            if entry.is_dir() and not entry.is_symlink():
                _tree.discard(entry)
            else:  # a stray file of that name
                entry.unlink(missing_ok=True)
            entry.with_name(f".{name}.lock").unlink(missing_ok=True)
            out.append(f"removed stale shifted copy {entry}")
    return out


def _idmap_of(name: str) -> IdMap:
    """The range a shifted copy's name says (``<src>.shift-UID-GID-COUNT-KEY``); ValueError if it says none."""
    parts = name.rsplit(".shift-", 1)[1].split("-")
    if len(parts) != 4:
        raise ValueError(name)
    return IdMap(host_uid=int(parts[0]), host_gid=int(parts[1]), count=int(parts[2]))
