"""Memory accounting (``bunshin_async._accounting``): page images mapped copy-on-write are counted in full, once,
wherever the kernel placed the mapping (``/proc/PID/maps`` pads low addresses with zeros, ``map_files`` does not);
the background monitor leaves cleanly when cancelled."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest

from bunshin_async._accounting import ResourceMonitor, mapped_image_bytes, tree_bytes

MAPPER = r"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size
MAP_FIXED_NOREPLACE = 0x100000
for hint, flags in ((0x0A000000, MAP_FIXED_NOREPLACE), (0, 0)):  # a low address, then wherever the kernel likes
    addr = libc.mmap(hint, size, mmap.PROT_READ, mmap.MAP_PRIVATE | flags, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
print("mapped", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def image() -> Path:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path = Path(d) / "pages-1.img"
        path.write_bytes(b"\x01" * (3 << 20))
        yield path  # type: ignore[misc]


def test_mapped_image_counted_once_at_low_and_high_addresses(image: Path) -> None:
    args = [sys.executable, "-c", MAPPER, str(image)]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "mapped\n"
            maps = [line for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines() if str(image) in line]
            assert any(line.startswith("0a000000-") for line in maps), maps
            total, inodes = mapped_image_bytes([proc.pid])
            assert total == 3 << 20  # nothing touched: the whole file, counted once for two mappings
            assert inodes == {(image.stat().st_dev, image.stat().st_ino)}
            assert tree_bytes(image.parent, inodes) == 0  # a caller walking the directory skips it
            assert tree_bytes(image.parent) >= 3 << 20
        finally:
            proc.kill()


@pytest.mark.unit
async def test_a_monitor_whose_body_is_cancelled_leaves_its_scopes_in_order() -> None:
    # Its exit used to await the last sample first: cancelled there, it never left its task group, and every
    # enclosing scope then failed with "Attempted to exit a cancel scope that isn't the current task's".
    with anyio.CancelScope() as outer:
        async with ResourceMonitor(interval=0.01) as monitor:
            await anyio.sleep(0.05)
            outer.cancel()
            await anyio.sleep(1)
    assert outer.cancelled_caught
    assert monitor.report().samples  # the last sample was still taken
