"""Memory accounting (``bunshin_async._workspace._accounting``): page images mapped copy-on-write are counted in full,
once, wherever the kernel placed the mapping (``/proc/PID/maps`` pads low addresses with zeros, ``map_files`` does not);
the background monitor leaves cleanly when cancelled."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from bunshin_async import InvalidValue, Limits, Workspace
from bunshin_async._config import Config
from bunshin_async._host import _criu
from bunshin_async._workspace._accounting import (
    COUNTED,
    ResourceMonitor,
    _mapped_images,
    accounting_scope,
    held_memory,
    mapped_image_bytes,
    tree_bytes,
    workspace_memory,
    written_bytes,
)
from tests._walks import Walks

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


@pytest.mark.unit
async def test_scoped_settings_reach_the_tasks_and_threads_started_inside_and_nothing_else() -> None:
    """``Config.scoped`` is per task: what a scoped task starts (tasks, worker threads) sees it; a sibling started
    outside, and the caller after the block, do not."""
    outer = Config.current().cgroup_parent
    seen: dict[str, str] = {}
    started = anyio.Event()
    release = anyio.Event()

    async def sibling() -> None:
        started.set()
        await release.wait()
        seen["sibling"] = Config.current().cgroup_parent

    async with anyio.create_task_group() as tg:
        tg.start_soon(sibling)
        await started.wait()
        with Config.scoped(cgroup_parent=f"{outer}/run-x") as config:
            assert config.cgroup_parent == f"{outer}/run-x"

            async def child() -> None:
                seen["child"] = Config.current().cgroup_parent

            tg.start_soon(child)
            seen["thread"] = await anyio.to_thread.run_sync(lambda: Config.current().cgroup_parent)
            with Config.scoped(snapshot_dir="/dev/shm/x"):  # nested: adds to the enclosing scope
                assert Config.current().cgroup_parent == f"{outer}/run-x"
                assert Config.current().snapshot_dir == Path("/dev/shm/x")
        release.set()
    assert seen == {"child": f"{outer}/run-x", "thread": f"{outer}/run-x", "sibling": outer}
    assert Config.current().cgroup_parent == outer
    with pytest.raises(InvalidValue, match="unknown settings"):
        with Config.scoped(cgroup_root="x"):
            pass


BURN = "import resource; sum(range(10_000_000)); r = resource.getrusage(resource.RUSAGE_SELF); print(r.ru_utime + r.ru_stime)"  # noqa: E501


async def test_a_scope_reads_every_workspace_made_inside_and_the_cpu_of_processes_gone() -> None:
    """A workspace and its fork made inside a scope are in its subtree, without anyone tracking them: their
    processes' memory is read, the CPU of a process that has exited stays in the subtree's counter (at least what
    the process itself reported), and on exit the scope leaves no cgroup and no snapshot directory."""
    outer = Config.current().cgroup_parent
    with accounting_scope("test") as subtree:
        assert subtree.parent.startswith(f"{outer}/test-")
        assert Config.current().cgroup_parent == subtree.parent  # inside: workspaces go there
        assert subtree.snapshot_dir is not None and subtree.snapshot_dir.is_dir()
        assert await anyio.to_thread.run_sync(subtree.cpu_seconds) == 0.0  # made now, counters at zero
        async with Workspace() as ws:
            [copy] = await ws.fork(1)
            try:
                r = await copy.exec(["python3", "-c", BURN])
                burned = float(r.stdout)
                await copy.spawn(["python3", "-c", "x = bytearray(64 << 20); x[::4096] = b'1' * (16384); "
                                  "open('/workspace/ready', 'w').close(); import time; time.sleep(1e6)"])  # fmt: skip
                with anyio.fail_after(60):
                    while (await copy.exec("test -e /workspace/ready")).exit_code:  # noqa: ASYNC110 - polls the guest
                        await anyio.sleep(0.05)
                usage = await anyio.to_thread.run_sync(subtree.read)
                assert set(ws.cgroup.pids()) | set(copy.cgroup.pids()) <= set(subtree.pids())  # type: ignore[union-attr]
                assert usage.cgroups == 2 and usage.pss_bytes >= 64 << 20, usage
                assert usage.cpu_seconds is not None and usage.cpu_seconds >= burned > 0, (usage, burned)
            finally:
                await copy.aclose()
        after = await anyio.to_thread.run_sync(subtree.read)
        assert after.processes == 0 and after.cgroups == 0
        assert after.cpu_seconds is not None and after.cpu_seconds >= usage.cpu_seconds  # the gone stay counted
    assert subtree.roots() == [] and not subtree.snapshot_dir.exists()
    assert Config.current().cgroup_parent == outer


async def _two_copies_of_a_heap(ws: Workspace) -> list[Workspace]:
    """Two copy-on-write copies of ``ws`` once a guest holds a 64 MiB heap (each copy maps its page image)."""
    await ws.spawn(["python3", "-c", "x = bytearray(64 << 20); x[::4096] = b'1' * (16384); "
                    "open('/workspace/ready', 'w').close(); import time; time.sleep(1e6)"])  # fmt: skip
    with anyio.fail_after(60):
        while (await ws.exec("test -e /workspace/ready")).exit_code:  # noqa: ASYNC110 - polls the guest
            await anyio.sleep(0.05)
    return await ws.fork(2)


async def test_copies_read_together_count_their_shared_page_image_once() -> None:
    """What a Ray host reports it holds (``held_memory`` over its workspaces): two copy-on-write copies of one
    workspace map the same page image; read one by one each counts it, read together it counts once."""
    async with Workspace() as ws:
        copies = await _two_copies_of_a_heap(ws)
        try:
            assert [c.fork_mode for c in copies] == ["criu-cow", "criu-cow"]
            alone = [await anyio.to_thread.run_sync(workspace_memory, c) for c in copies]
            together = await anyio.to_thread.run_sync(held_memory, copies)
            assert min(alone) >= 64 << 20, alone  # each copy holds the image its memory lives in
            assert max(alone) <= together <= sum(alone) - (48 << 20), (alone, together)
            assert await anyio.to_thread.run_sync(held_memory, [copies[0]]) == pytest.approx(alone[0], rel=0.05)
        finally:
            for c in copies:
                await c.aclose()


def _smaps_images(pids: list[int]) -> dict[tuple[int, int], int]:
    """The PSS of each page image mapped by ``pids``, by (dev, ino), from every process's smaps (no maps first)."""
    pss: dict[tuple[int, int], int] = {}
    for pid in pids:
        key = None
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            fields = line.split(None, 5)
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                key = None
                if len(fields) == 6 and "/pages-" in fields[5] and ".img" in fields[5]:
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    key = (os.makedev(major, minor), int(fields[4]))
            elif key is not None and line.startswith("Pss:"):
                pss[key] = pss.get(key, 0) + int(line.split()[1]) * 1024
    return pss


async def test_a_reading_walks_two_hierarchies_and_the_smaps_of_image_mappers_alone() -> None:
    """A subtree reading walks the memory and cpuacct hierarchies only (``COUNTED``) and reads the smaps only of
    the processes whose maps name a page image: the processes it finds are those of all six hierarchies, and the
    page images' PSS is every process's smaps' (copies of a workspace with a 64 MiB heap map their image)."""
    with accounting_scope("counted") as subtree:
        async with Workspace() as ws:
            copies = await _two_copies_of_a_heap(ws)
            try:

                def read() -> tuple[list[int], list[int], dict[tuple[int, int], int], dict[tuple[int, int], int]]:
                    every = subtree.pids()
                    counted = subtree.pids(subtree.cgroups(subtree.roots(COUNTED)))
                    return every, counted, _mapped_images(counted)[1], _smaps_images(every)

                every, counted, images, expected = await anyio.to_thread.run_sync(read)
                assert len(subtree.roots()) > len(subtree.roots(COUNTED)) or len(subtree.roots()) == 1
                assert counted == every and len(every) >= 6  # three workspaces: init, agent; the heap
                assert images == expected and len(images) >= 1, (images, expected)  # idle: no PSS moves between
            finally:
                for c in copies:
                    await c.aclose()


MANY_FILES = (  # 3000 small files in nested directories, a 5 MiB file, 1 MiB written into a sparse 64 MiB, a symlink
    "import os\n"
    "for d in range(30):\n"
    "    os.makedirs(f'/workspace/many/{d}/sub')\n"
    "    for f in range(100):\n"
    "        open(f'/workspace/many/{d}/sub/{f}', 'w').write('x' * (f * 97))\n"
    "open('/workspace/big', 'wb').write(os.urandom(5 << 20))\n"
    "with open('/workspace/sparse', 'wb') as s:\n"
    "    s.truncate(64 << 20); s.seek(32 << 20); s.write(os.urandom(1 << 20))\n"
    "os.symlink('/etc/passwd', '/workspace/link')\n"
)


async def test_a_workspace_s_written_bytes_are_its_own_disk_s_count_not_a_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """``workspace_memory`` reads a workspace's upper dir (what it wrote) from the kernel: the pages its own tmpfs
    (``Limits.disk``) holds, less the host's files beside the upper. The figure is the walk's, byte for byte (a
    hard link counts once: the walk counted its file per name), for a created workspace and for a restored copy
    (CRIU's ``restore.log`` beside its upper), and it walks nothing; a workspace without a disk of its own is
    walked."""
    async with Workspace() as ws:
        assert (await ws.exec(f"python3 -c {shlex.quote(MANY_FILES)}")).exit_code == 0
        walks = Walks().install(monkeypatch)
        upper = ws.directory / "upper"
        read = await anyio.to_thread.run_sync(written_bytes, ws.directory)
        memory = await anyio.to_thread.run_sync(workspace_memory, ws)
        assert walks.roots == []  # neither walked the 3000 files
        walked = await anyio.to_thread.run_sync(tree_bytes, upper)
        assert read == walked and walked > 6 << 20, (read, walked)
        assert memory >= read
        assert (await ws.exec("ln /workspace/big /workspace/big.again")).exit_code == 0
        assert await anyio.to_thread.run_sync(written_bytes, ws.directory) == read
        assert await anyio.to_thread.run_sync(tree_bytes, upper) == walked + (5 << 20)
        [copy] = await ws.fork(1)
        try:
            assert (copy.directory / "restore.log").stat().st_blocks > 0
            assert (await copy.exec("head -c 300000 /workspace/big > /workspace/copied")).exit_code == 0
            walks.roots.clear()
            read = await anyio.to_thread.run_sync(written_bytes, copy.directory)
            assert walks.roots == []
            walked = await anyio.to_thread.run_sync(tree_bytes, copy.directory / "upper")
            assert read == walked and walked >= 300000, (read, walked)
        finally:
            await copy.aclose()
    async with Workspace(limits=Limits(disk=None)) as plain:
        assert (await plain.exec("head -c 100000 /dev/urandom > /workspace/f")).exit_code == 0
        walks.roots.clear()
        read = await anyio.to_thread.run_sync(written_bytes, plain.directory)
        assert walks.roots == [plain.directory / "upper"]
        assert read == await anyio.to_thread.run_sync(tree_bytes, plain.directory / "upper") and read >= 100000


async def test_a_fork_s_dump_runs_in_the_scope_so_its_cpu_is_the_run_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU dumps for the run: while it works (its post-dump notification) its process is in the scope's subtree,
    whose CPU counter therefore includes every dump; the cgroup it ran in is gone once the fork returns."""
    seen: dict[str, object] = {}

    class Watching(_criu.SwrkCriu):
        def __init__(self) -> None:
            super().__init__(on_spawn=self._spawned)

        async def _spawned(self, pid: int) -> None:
            seen.setdefault("pids", []).append(pid)  # type: ignore[attr-defined]

        async def call(self, req: Any, *, notify: Any = None, **kw: Any) -> Any:
            async def watched(name: str, pid: int) -> None:
                if name == "post-dump":  # in the hierarchies a reading walks (cpuacct: CRIU's is there alone)
                    counted = await anyio.to_thread.run_sync(lambda: subtree.cgroups(subtree.roots(COUNTED)))
                    seen["in subtree"] = await anyio.to_thread.run_sync(subtree.pids, counted)
                if notify is not None:
                    await notify(name, pid)

            return await super().call(req, notify=watched, **kw)

    monkeypatch.setattr(_criu, "default_backend", Watching)
    with accounting_scope("dump") as subtree:
        async with Workspace() as ws:
            [copy] = await ws.fork(1)
            try:
                dumper = seen["pids"][0]  # type: ignore[index]
                assert dumper in seen["in subtree"]  # type: ignore[operator]
                usage = await anyio.to_thread.run_sync(subtree.read)
                assert usage.cgroups == 2, usage  # the source and its copy: the dump's cgroup went with CRIU
            finally:
                await copy.aclose()


async def test_a_workspace_file_named_like_a_page_image_is_not_counted() -> None:
    """Page images are told by their name (``/pages-N.img``), which a workspace can give any file it maps: a 1 TiB
    sparse file of its own, so named and mapped, must not count as a TiB it holds (only the snapshot store's images
    do)."""
    async with Workspace() as ws:
        await ws.spawn(["python3", "-c", "import mmap, os, time; "
                        "f = os.open('/tmp/pages-1.img', os.O_RDWR | os.O_CREAT); "
                        "os.ftruncate(f, 1 << 40); m = mmap.mmap(f, 1 << 40, mmap.MAP_PRIVATE, mmap.PROT_READ); "
                        "open('/workspace/ready', 'w').close(); time.sleep(1e6)"])  # fmt: skip
        with anyio.fail_after(60):
            while (await ws.exec("test -e /workspace/ready")).exit_code:  # noqa: ASYNC110 - polls the guest
                await anyio.sleep(0.05)
        assert await anyio.to_thread.run_sync(workspace_memory, ws) < 1 << 30


async def test_a_scope_on_a_plain_store_unmounts_the_store_its_forks_mounted(tmp_path: Path) -> None:
    """A snapshot store configured on a directory that is no tmpfs: the scope mounts one on its directory (large
    folios for its images; its bytes counted by the kernel); when the scope ends, with its snapshots gone, that
    mount and the directory go with it."""
    store = tmp_path / "store"
    store.mkdir()
    with Config.scoped(snapshot_dir=store), accounting_scope("plain") as subtree:
        assert subtree.snapshot_dir is not None
        async with Workspace() as ws:
            [copy] = await ws.fork(1)
            await copy.aclose()
        assert os.path.ismount(subtree.snapshot_dir)
    assert not subtree.snapshot_dir.exists()
    assert [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(store) in line] == []


async def test_what_a_workspace_wrote_counts_in_its_run_s_reading_and_in_a_tracked_one() -> None:
    """A file a workspace wrote lives in its upper dir, a tmpfs of its own that no process maps: PSS does not show
    it, yet it is memory the run holds for as long as the workspace lives. A subtree reading and a monitor tracking
    the workspace both count it (once), and not after the workspace is gone."""
    with accounting_scope("uppers") as subtree:
        async with Workspace() as ws:
            before = await anyio.to_thread.run_sync(subtree.read)
            await ws.exec(["python3", "-c", "open('/workspace/big', 'wb').write(b'1' * (48 << 20))"])
            usage = await anyio.to_thread.run_sync(subtree.read)
            assert usage.upper_bytes - before.upper_bytes >= 48 << 20, (before, usage)
            assert usage.memory_bytes - usage.pss_bytes - usage.image_bytes - usage.snapshot_bytes == usage.upper_bytes
            assert usage.upper_bytes == await anyio.to_thread.run_sync(written_bytes, ws.directory)
            monitor = ResourceMonitor(interval=60)
            monitor.track(ws)
            async with monitor:
                pass
            [*_, last] = monitor.report().samples
            assert last.extra_bytes >= 48 << 20, last
        after = await anyio.to_thread.run_sync(subtree.read)
        assert after.upper_bytes == 0 and after.cgroups == 0, after


async def test_a_scope_s_snapshot_bytes_are_its_own_tmpfs_s_count_not_a_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scope's snapshot directory is a tmpfs of its own, so a subtree reading (every 0.1 s in the experiment)
    takes the run's snapshot bytes from the kernel's count and walks nothing of what the run stored; the figure is
    the walk's, byte for byte, the page images a copy maps left out as the walk leaves them out."""
    with accounting_scope("stored") as subtree:
        assert subtree.snapshot_dir is not None and os.path.ismount(subtree.snapshot_dir)
        async with Workspace() as ws:
            assert (await ws.exec(f"python3 -c {shlex.quote(MANY_FILES)}")).exit_code == 0
            await ws.spawn(["python3", "-c", "x = bytearray(64 << 20); x[::4096] = b'1' * (16384); "
                            "open('/workspace/ready', 'w').close(); import time; time.sleep(1e6)"])  # fmt: skip
            with anyio.fail_after(60):
                while (await ws.exec("test -e /workspace/ready")).exit_code:  # noqa: ASYNC110 - polls the guest
                    await anyio.sleep(0.05)
            snap = await ws.snapshot()
            [copy] = await Workspace.from_snapshot(snap)
            try:
                walks = Walks().install(monkeypatch)
                usage = await anyio.to_thread.run_sync(subtree.read)
                assert walks.under(subtree.snapshot_dir) == []
                sizes, _ = await anyio.to_thread.run_sync(_mapped_images, subtree.pids())
                store_dev = subtree.snapshot_dir.stat().st_dev
                assert any(dev == store_dev for dev, _ino in sizes), sizes  # the copy maps its image from there
                walked = await anyio.to_thread.run_sync(tree_bytes, subtree.snapshot_dir, set(sizes))
                assert usage.snapshot_bytes == walked and walked > 6 << 20, (usage, walked)
            finally:
                await copy.aclose()
                await snap.aclose()
    assert not subtree.snapshot_dir.exists()
    assert [
        line for line in Path("/proc/self/mounts").read_text().splitlines() if subtree.snapshot_dir.name in line
    ] == []
