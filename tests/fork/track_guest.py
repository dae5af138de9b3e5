"""Runs inside a workspace (python3 track_guest.py): private anonymous memory the write-tracking tests change
between checkpoints (tests/fork/test_track_writes.py). It holds a 16 MiB buffer (and a 32 MiB ``PROT_NONE``
reservation it never touches); for each request file /workspace/req-<n>, in order, it runs the command in it and
answers the digest of all it holds in /workspace/ans-<n> (written by rename): ``write K`` adds 1 to one byte in each
of K pages of the buffer spread over it, ``map M`` maps M MiB more (a new VMA) and fills every page, ``zap K`` drops
the buffer's first K pages (``MADV_DONTNEED``: they read as zeros), ``digest`` only answers. A restored copy answers
its next request."""

import hashlib
import mmap
import os
import time

PAGE = 4096
FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # Python's default anonymous mmap is MAP_SHARED (shmem)


def mapping(mib, seed):
    m = mmap.mmap(-1, mib << 20, flags=FLAGS)
    for i in range(0, len(m), PAGE):
        m[i] = (i // PAGE + seed) % 251 + 1
    return m


def main():
    # a reservation never touched, as malloc arenas keep (PROT_NONE): armed, its holes hold uffd-wp PTE markers,
    # which no dump may take for pages (32 MiB of them would be 8192 pages of zeros in every first snapshot)
    reserved = mmap.mmap(-1, 32 << 20, flags=FLAGS, prot=0)  # noqa: F841 - PROT_NONE, kept mapped
    bufs = [mapping(16, 0)]
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
        elif cmd == "zap":
            bufs[0].madvise(mmap.MADV_DONTNEED, 0, int(arg[0]) * PAGE)
        h = hashlib.sha256()
        for b in bufs:
            h.update(b)
        with open(f"/workspace/ans-{n}.tmp", "w") as f:
            f.write(h.hexdigest())
        os.rename(f"/workspace/ans-{n}.tmp", f"/workspace/ans-{n}")
        n += 1


main()
