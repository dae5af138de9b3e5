"""Snapshots exported from one host and imported into another (its own home, workspaces dir, snapshot store and
cgroups): restored with their processes' memory, copy-on-write among the copies there; corrupted, truncated and
hostile streams are refused with nothing left behind."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from bunshin_async import TransferError, Workspace
from bunshin_async._fork import _transfer
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._snapstore import layers_dir, snapshot_dir
from bunshin_async.transfer import export_snapshot, import_snapshot
from tests.transfer._homes import Home

HERE = Path(__file__).parent
MIB = 24


async def ask(ws: Workspace) -> tuple[str, int]:
    """The digest of the guest's memory and how many times it was asked (state only its memory holds)."""
    await ws.write_file("/workspace/ask", "1")
    with anyio.fail_after(30):
        while True:
            r = await ws.exec("cat /workspace/answer 2>/dev/null && rm /workspace/answer")
            if r.exit_code == 0 and r.stdout:
                digest, n = r.stdout.split()
                return digest, int(n)
            await anyio.sleep(0.02)


async def start_guest(ws: Workspace) -> None:
    await ws.write_file("/workspace/memory_guest.py", (HERE / "memory_guest.py").read_bytes())
    await ws.spawn(["python3", "/workspace/memory_guest.py", str(MIB)], log_path="/workspace/guest.log")
    with anyio.fail_after(60):
        while (await ws.exec("test -e /workspace/ready")).exit_code:
            await anyio.sleep(0.05)


async def frames_of(snap: object) -> list[bytes]:
    return [f async for f in export_snapshot(snap)]  # type: ignore[arg-type]


async def feed(frames: list[bytes]) -> AsyncIterator[bytes]:
    for f in frames:
        yield f


def mapped_from(ws: Workspace, store: Path) -> bool:
    """Whether a process of ``ws`` maps a page image of ``store`` (its memory is the image's, copy-on-write)."""
    assert ws.cgroup is not None
    for pid in ws.cgroup.pids():
        try:
            if str(store) in Path(f"/proc/{pid}/maps").read_text():
                return True
        except OSError:
            continue
    return False


async def test_export_import_restores_memory_cow(other: Home) -> None:
    async with Workspace() as ws:
        await start_guest(ws)
        await ws.write_file("/workspace/notes.txt", "from host a\n")
        digest, n = await ask(ws)
        async with await ws.snapshot() as snap:
            frames = await frames_of(snap)
            # A fork of a fork: its memory image is incremental on its parent's, its files a second layer.
            (child,) = await Workspace.from_snapshot(snap, 1)
        try:
            await child.exec("rm /workspace/notes.txt && echo child > /workspace/child.txt")
            assert await ask(child) == (digest, n + 1)
            async with await child.snapshot() as nested:
                nested_frames = await frames_of(nested)
        finally:
            await child.aclose()
    assert not list(snapshot_dir().iterdir())  # host a holds nothing of them any more

    with other.active():
        snap2, stats = await import_snapshot(feed(frames))
        assert stats.bytes > MIB << 20 and stats.bandwidth > 0
        async with snap2:
            copies = await Workspace.from_snapshot(snap2, 2)
            try:
                for c in copies:
                    assert c.fork_mode == "criu-cow"
                    assert mapped_from(c, other.snapdir)
                    assert await ask(c) == (digest, n + 1)
                    assert (await c.read_text("/workspace/notes.txt")) == "from host a\n"
            finally:
                for c in copies:
                    await c.aclose()
        nested2, _ = await import_snapshot(feed(nested_frames))
        async with nested2:
            assert len(record_of(nested2).lower.split(":")) == 4  # its layer, its parent's layer, agent layer, image
            (c,) = await Workspace.from_snapshot(nested2, 1)
            try:
                assert c.fork_mode == "criu-cow"
                assert await ask(c) == (digest, n + 2)
                r = await c.exec("cat /workspace/child.txt; test -e /workspace/notes.txt")
                assert (r.stdout, r.exit_code) == ("child\n", 1)
            finally:
                await c.aclose()


@pytest.fixture
async def stream() -> list[bytes]:
    async with Workspace() as ws:
        await start_guest(ws)
        async with await ws.snapshot() as snap:
            return await frames_of(snap)


def nothing_imported(home: Home) -> None:
    with home.active():
        assert not list(snapshot_dir().iterdir())
        assert not layers_dir().exists() or not list(layers_dir().iterdir())


async def test_corrupted_truncated_and_reordered_streams_are_refused(other: Home, stream: list[bytes]) -> None:
    assert len(stream) >= 4
    mid = len(stream) // 2
    corrupted = list(stream)
    flipped = bytearray(corrupted[mid])
    flipped[len(flipped) // 2] ^= 0x01
    corrupted[mid] = bytes(flipped)
    whole = b"".join(stream)
    cases = {
        "corrupted": corrupted,
        "truncated at a frame": stream[:-1],
        "truncated mid-frame": [whole[: len(whole) - 1000]],
        "reordered": [stream[0], stream[2], stream[1], *stream[3:]],
        "trailing bytes": [*stream, b"x"],
        "not a stream": [b"hello world" * 10],
    }
    with other.active():
        for name, frames in cases.items():
            with pytest.raises(TransferError) as info:
                await import_snapshot(feed(frames))
            assert info.value.snapshot_id is not None, name
            nothing_imported(other)
        # Re-chunked bytes import the same: the frames are self-delimiting.
        snap, _ = await import_snapshot(feed([whole[i : i + (1 << 16)] for i in range(0, len(whole), 1 << 16)]))
        await snap.aclose()
    nothing_imported(other)


async def test_interrupted_and_cancelled_imports_leave_nothing(other: Home, stream: list[bytes]) -> None:
    class SourceDied(Exception):
        pass

    async def dies_midway() -> AsyncIterator[bytes]:
        for f in stream[: len(stream) // 2]:
            yield f
        raise SourceDied

    async def stalls() -> AsyncIterator[bytes]:
        for f in stream[: len(stream) // 2]:
            yield f
        await anyio.sleep_forever()
        yield b""

    with other.active():
        with pytest.raises(SourceDied):
            await import_snapshot(dies_midway())
        nothing_imported(other)
        with anyio.move_on_after(1):
            await import_snapshot(stalls())
        nothing_imported(other)


async def test_device_nodes_in_a_layer_are_refused(other: Home) -> None:
    import os
    import stat

    async with Workspace() as ws:
        await ws.write_file("/workspace/x", "1")
        async with await ws.snapshot() as snap:
            await record_of(snap).materialize()
            node = record_of(snap).layer / "workspace" / "mem"
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 1))  # /dev/mem: what a hostile sender would add
            try:
                frames = await frames_of(snap)
            finally:
                node.unlink()
    with other.active(), pytest.raises(TransferError, match="device node"):
        await import_snapshot(feed(frames))
    nothing_imported(other)


REFUSED = r"path of \d+ bytes \(workspace/deep/a+/\.\.\. \d+ levels deep\), deeper than the 4096-byte PATH_MAX"
DEEP = "d=deep; for i in $(seq 300); do d=$d/" + "a" * 15 + "; done; mkdir -p $d && echo x > keep"


async def test_a_tree_deeper_than_path_max_is_refused_clearly(other: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """A workspace may build a tree deeper than PATH_MAX (4,800 bytes of path here), which GNU tar cannot extract
    by name: the export refuses it before its first frame, naming the reason, and holds nothing afterwards; a stream
    that holds one anyway (a sender without that check) is refused at import, naming it too, with nothing left."""
    async with Workspace() as ws:
        assert (await ws.exec(DEEP)).exit_code == 0
        async with await ws.snapshot() as snap:
            sent: list[bytes] = []
            with pytest.raises(TransferError, match=REFUSED) as info:
                async for frame in export_snapshot(snap):
                    sent.append(frame)
            assert sent == [] and info.value.snapshot_id == snap.id
            assert len(str(info.value)) < 1000  # the path is shown elided
            with monkeypatch.context() as m:  # what a sender without the check sends
                m.setattr(_transfer, "_check_extractable", lambda record: None)
                frames = await frames_of(snap)
            (copy,) = await Workspace.from_snapshot(snap)  # the snapshot itself is whole
            await copy.aclose()
        with other.active(), pytest.raises(TransferError, match="longer than the 4096-byte PATH_MAX") as info:
            await import_snapshot(feed(frames))
        assert info.value.snapshot_id == snap.id
        nothing_imported(other)
        # without the deep tree the same workspace travels
        assert (await ws.exec("rm -rf deep && test -e keep")).exit_code == 0
        async with await ws.snapshot() as snap:
            frames = await frames_of(snap)
    with other.active():
        imported, _ = await import_snapshot(feed(frames))
        async with imported:
            (copy,) = await Workspace.from_snapshot(imported)
            try:
                assert (await copy.exec("cat keep; test -e deep")).stdout == "x\n"
            finally:
                await copy.aclose()
