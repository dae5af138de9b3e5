"""Hostile trees, built as root inside a workspace (python3 of the base image): ``python3 trees_guest.py build ROOT
CANARY [TREE...]`` makes one directory per tree under ROOT (symlinks aim at the host path CANARY) and prints what the
kernel allowed as JSON; ``python3 trees_guest.py print ROOT [--no-sockets]`` prints a fingerprint of ROOT (every
entry's name bytes, type, mode, size, link target, hard-link group and data runs), walked from descriptors so that a
tree deeper than PATH_MAX is read whole."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import stat
import sys

DEEP_LEVELS = 300  # 300 x 16 bytes: 4800 bytes of path, past PATH_MAX (4096)
DEEP_NAME = b"a" * 15


def _links(d: str, canary: str) -> dict[str, object]:
    os.symlink(canary + "/secret", f"{d}/abs")  # a host file, by its host path
    os.symlink(canary, f"{d}/absdir")  # a host directory
    os.symlink("../" * 40 + canary.lstrip("/"), f"{d}/rel")  # climbing far above the root
    os.symlink("nowhere", f"{d}/dangling")
    os.symlink("loop2", f"{d}/loop1")
    os.symlink("loop1", f"{d}/loop2")
    os.symlink("/proc/1/root/etc", f"{d}/proc")
    return {}


def _hardlinks(d: str, canary: str) -> dict[str, object]:
    with open(f"{d}/one", "w") as f:
        f.write("shared")
    os.link(f"{d}/one", f"{d}/two")
    os.link(f"{d}/one", f"{d}/three")
    try:
        os.link("/etc/hostname", f"{d}/image-file")  # a lower file: overlayfs copies it up first
        return {"image_link": None}
    except OSError as exc:
        return {"image_link": errno.errorcode[exc.errno or 0]}


def _special(d: str, canary: str) -> dict[str, object]:
    os.mkfifo(f"{d}/fifo")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(f"{d}/sock")
    out: dict[str, object] = {}
    for name, mode, dev in (
        ("null", stat.S_IFCHR, os.makedev(1, 3)),
        ("sda", stat.S_IFBLK, os.makedev(8, 0)),
        ("zero-zero", stat.S_IFCHR, 0),
    ):
        try:
            os.mknod(f"{d}/{name}", mode | 0o666, dev)
            out[name] = None
        except OSError as exc:
            out[name] = errno.errorcode[exc.errno or 0]
    os.unlink("/etc/issue.net")  # a whiteout in the upper dir
    return out


def _sparse(d: str, canary: str) -> dict[str, object]:
    with open(f"{d}/tera", "wb") as f:
        f.truncate(1 << 40)
        f.seek(1 << 39)
        f.write(b"in the middle of a tebibyte")
    return {}


def _names(d: str, canary: str) -> dict[str, object]:
    base = os.fsencode(d)
    for name in (b"new\nline", b"bad\xff\xfeutf8", b"-rf", b" lead", b"x" * 255, b"tab\tand\x01ctl"):
        with open(base + b"/" + name, "wb") as f:
            f.write(name)
    os.mkdir(base + b"/dir\nwith\xffnewline")
    return {}


def _deep(d: str, canary: str) -> dict[str, object]:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(DEEP_LEVELS):
        os.mkdir(DEEP_NAME, dir_fd=fd)
        nfd = os.open(DEEP_NAME, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.symlink(canary + "/secret", "abs", dir_fd=fd)
    wfd = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(wfd, b"at the bottom")
    os.close(wfd)
    os.close(fd)
    return {}


TREES = {
    "links": _links,
    "hardlinks": _hardlinks,
    "special": _special,
    "sparse": _sparse,
    "names": _names,
    "deep": _deep,
}


def build(root: str, canary: str, names: list[str]) -> None:
    out = {}
    for name in names or list(TREES):
        d = f"{root}/{name}"
        os.makedirs(d)
        out[name] = TREES[name](d, canary)
    print(json.dumps(out))


def fingerprint(root: str, sockets: bool) -> None:
    h = hashlib.sha256()
    groups: dict[int, int] = {}
    count = 0
    base = os.fsencode(root)
    for top, dirs, files, dfd in os.fwalk(base):  # descriptors: no PATH_MAX limit
        dirs.sort()
        for name in sorted(dirs + files):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            kind = stat.S_IFMT(st.st_mode)
            if kind == stat.S_IFSOCK and not sockets:
                continue
            rec: list[object] = [top[len(base) :] + b"/" + name, kind, stat.S_IMODE(st.st_mode), st.st_uid]
            if kind != stat.S_IFDIR:
                rec += [st.st_size, st.st_rdev, int(st.st_mtime)]
                if st.st_nlink > 1:
                    rec.append(groups.setdefault(st.st_ino, len(groups)))
            if kind == stat.S_IFLNK:
                rec.append(os.readlink(name, dir_fd=dfd))
            if kind == stat.S_IFREG:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                pos = 0
                while True:  # the data runs only: a 1 TiB sparse file is read where it holds data
                    try:
                        pos = os.lseek(fd, pos, os.SEEK_DATA)
                    except OSError:
                        break
                    chunk = os.pread(fd, 1 << 20, pos)
                    if not chunk:
                        break
                    rec.append((pos, hashlib.sha256(chunk).hexdigest()))
                    pos += len(chunk)
                os.close(fd)
            h.update(repr(rec).encode())
            count += 1
    print(json.dumps({"entries": count, "sha256": h.hexdigest(), "whiteout": not os.path.lexists("/etc/issue.net")}))


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        fingerprint(sys.argv[2], "--no-sockets" not in sys.argv)
