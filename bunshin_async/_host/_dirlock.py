"""flock(2) on a directory itself, between the processes that make entries in it (shared) and ``bunshin gc``
(exclusive): a collection beside other processes never sees an entry made and not yet owned (a workspace directory
before its ``owner`` file, a snapshot before its users). No lock file: a clean directory stays empty."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def lock_dir(path: Path, *, exclusive: bool = False, wait: bool = True, make: bool = False) -> int | None:
    """A descriptor of ``path`` holding the lock (close it to let go; blocking when ``wait``). None when ``path``
    does not exist (``make``: it is made), or when ``wait`` is false and another process holds a conflicting lock.
    A collection removes an empty directory under its lock and the next user makes it again: a lock taken on the
    removed one would exclude no one, so it is taken again on the directory now at ``path``."""
    while True:
        if make:
            path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if make:
                continue
            return None
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        held = os.fstat(fd)
        with contextlib.suppress(FileNotFoundError):
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return fd
        os.close(fd)
        if not make:
            return None
