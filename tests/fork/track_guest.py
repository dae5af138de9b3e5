"""Runs inside a workspace (python3 track_guest.py): private anonymous memory the write-tracking tests change
between checkpoints (tests/fork/test_track_writes.py, test_smaps_early.py). It holds a 16 MiB buffer, a 32 MiB
``PROT_NONE`` reservation and a 64 KiB mapping of its own; for each request file /workspace/req-<n>, in order, it runs
the command in it and answers the digest of all it holds in /workspace/ans-<n> (written by rename): ``write K`` adds 1
to one byte in each of K pages of the buffer spread over it, ``map M`` maps M MiB more (a new VMA) and fills every
page, ``zap K`` drops the buffer's first K pages (``MADV_DONTNEED``: they read as zeros), ``drop K`` drops them too
and answers ``dropped`` instead of the digest (which reads every page: after ``zap`` they hold the zero page, after
``drop`` nothing until the next request), ``open`` makes the whole
reservation readable (``mprotect``: its zeros join the digest), ``lock`` locks the 64 KiB mapping, whole (``mlock``:
status ``VmLck`` joins the digest), ``fmap`` maps a 1.5 MiB file privately right after a 64 KiB anonymous mapping,
both inside one 2 MiB-aligned span (so a dump's pagemap cache scans them in one window), and reads every page of it
(present file pages: the file's content joins the digest), ``hide`` maps 64 KiB more, fills it and makes it
``PROT_NONE`` (its pages are present, unreadable, and not in the digest), ``show`` makes it readable again (its
content joins the digest), ``digest`` only answers. A restored copy answers its next request."""

import ctypes
import hashlib
import mmap
import os
import time

PAGE = 4096
FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # Python's default anonymous mmap is MAP_SHARED (shmem)
RESERVED = 32 << 20
LOCKABLE = 64 << 10
HIDDEN = 64 << 10
MAP_NORESERVE = 0x4000
MAP_FIXED = 0x10
SPAN = 2 << 20
FILE_BYTES = 3 << 19  # 1.5 MiB


def mapping(mib, seed):
    m = mmap.mmap(-1, mib << 20, flags=FLAGS)
    for i in range(0, len(m), PAGE):
        m[i] = (i // PAGE + seed) % 251 + 1
    return m


def file_after_anon(libc):
    """The ``fmap`` layout: 64 KiB of anonymous memory at a 2 MiB boundary, a private file mapping right after it."""
    with open("/workspace/fmap.bin", "wb") as f:
        for i in range(FILE_BYTES // PAGE):
            f.write(bytes([i % 249 + 3]) * PAGE)
    span = libc.mmap(None, 2 * SPAN, 0, FLAGS | MAP_NORESERVE, -1, 0)  # PROT_NONE, to place both in
    assert span not in (None, ctypes.c_void_p(-1).value)
    at = (span + SPAN - 1) & ~(SPAN - 1)
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    anon = libc.mmap(at, 64 << 10, rw, FLAGS | MAP_FIXED, -1, 0)
    assert anon == at
    ctypes.memset(anon, 5, 64 << 10)
    fd = os.open("/workspace/fmap.bin", os.O_RDONLY)
    try:
        mapped = libc.mmap(at + (64 << 10), FILE_BYTES, mmap.PROT_READ, mmap.MAP_PRIVATE | MAP_FIXED, fd, 0)
    finally:
        os.close(fd)
    assert mapped == at + (64 << 10)
    return mapped


def main():
    # a reservation never touched, as malloc arenas keep (PROT_NONE): armed, its holes hold uffd-wp PTE markers,
    # which no dump may take for pages (32 MiB of them would be 8192 pages of zeros in every first snapshot)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    reserved = libc.mmap(None, RESERVED, 0, FLAGS, -1, 0)  # PROT_NONE until ``open``, kept mapped
    assert reserved not in (None, ctypes.c_void_p(-1).value)
    # MAP_NORESERVE: a VMA no neighbour merges with, so that locking it changes its flags and nothing maps shows
    lockable = libc.mmap(None, LOCKABLE, mmap.PROT_READ | mmap.PROT_WRITE, FLAGS | MAP_NORESERVE, -1, 0)
    assert lockable not in (None, ctypes.c_void_p(-1).value)
    ctypes.memset(lockable, 7, LOCKABLE)
    bufs = [mapping(16, 0)]
    hidden = None
    opened = locked = shown = False
    fmapped = None
    n = 0
    while True:
        try:
            with open(f"/workspace/req-{n}") as f:
                cmd, *arg = f.read().split()
        except FileNotFoundError:
            time.sleep(0.01)
            continue
        pages = len(bufs[0]) // PAGE
        if cmd == "write":
            for j in range(int(arg[0])):
                off = (j * 7919 % pages) * PAGE
                bufs[0][off] = (bufs[0][off] + 1) % 256
        elif cmd == "map":
            bufs.append(mapping(int(arg[0]), len(bufs)))
        elif cmd in ("zap", "drop"):
            bufs[0].madvise(mmap.MADV_DONTNEED, 0, int(arg[0]) * PAGE)
        elif cmd == "open":
            if libc.mprotect(reserved, RESERVED, mmap.PROT_READ):
                raise OSError(ctypes.get_errno(), "mprotect")
            opened = True
        elif cmd == "fmap":
            fmapped = file_after_anon(libc)
        elif cmd == "lock":
            if libc.mlock(lockable, LOCKABLE):
                raise OSError(ctypes.get_errno(), "mlock")
            locked = True
        elif cmd == "hide":
            hidden = libc.mmap(None, HIDDEN, mmap.PROT_READ | mmap.PROT_WRITE, FLAGS | MAP_NORESERVE, -1, 0)
            assert hidden not in (None, ctypes.c_void_p(-1).value)
            for i in range(HIDDEN // PAGE):
                ctypes.memset(hidden + i * PAGE, i % 239 + 11, PAGE)
            if libc.mprotect(hidden, HIDDEN, 0):
                raise OSError(ctypes.get_errno(), "mprotect")
        elif cmd == "show":
            if libc.mprotect(hidden, HIDDEN, mmap.PROT_READ):
                raise OSError(ctypes.get_errno(), "mprotect")
            shown = True
        answer = "dropped"
        if cmd != "drop":
            h = hashlib.sha256()
            for b in bufs:
                h.update(b)
            if opened:
                h.update(ctypes.string_at(reserved, RESERVED))  # a copy that restored it PROT_NONE dies here
            if shown:
                h.update(ctypes.string_at(hidden, HIDDEN))  # a copy that lost its pages reads zeros here
            if fmapped is not None:
                h.update(ctypes.string_at(fmapped, FILE_BYTES))  # reads (faults in) every page of the file mapping
            if locked:
                with open("/proc/self/status") as f:
                    h.update(next(line for line in f if line.startswith("VmLck:")).encode())
            answer = h.hexdigest()
        with open(f"/workspace/ans-{n}.tmp", "w") as f:
            f.write(answer)
        os.rename(f"/workspace/ans-{n}.tmp", f"/workspace/ans-{n}")
        n += 1


main()
