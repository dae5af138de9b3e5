"""Snapshots that move: export a snapshot as a byte stream, import it into another host's snapshot store.

What a snapshot is on disk (``_fork``): a directory in the snapshot store (``BUNSHIN_SNAPDIR``, tmpfs) holding the
CRIU images, whose memory images may be incremental on a parent snapshot directory (its ``parent`` file, and CRIU's
``images/parent`` symlink ``../../<parent>/images``), and read-only overlay layers (``<workspaces dir>/.layers``):
the snapshot's own upper copy and those of the snapshots its workspace was forked from. Its record (image, limits,
env, the recorded spawns, ...) lives in the ``Snapshot`` object. An export carries all of it: the record, every
snapshot directory of the memory chain and every layer of the lower chain. The image and the agent layer are not
carried: the importing host must have the same ones (checked by digest and version).

The stream is a sequence of frames, each ``kind (1 byte) | length (4 bytes, big-endian) | sha256 (32 bytes) |
payload``, the digest taken over the frame's sequence number, kind and payload (so a frame that is corrupted,
dropped, repeated or moved is caught where it arrives): one header (``H``, the ``Header`` as JSON), the data frames
of two GNU tar archives (``S``: the snapshot directories, named ``snaps/<id>/...``; ``L``: the layers, named
``layers/<id>/...``; tar keeps the overlay's ``trusted.*`` xattrs, whiteouts, owners and hard links), and one
trailer (``T``: byte count and sha256 of all data, frame count). An import extracts into staging directories beside
their final places (same filesystems, so that installing is a rename), checks every entry (names, types: no device
node but overlay whiteouts, only CRIU's own ``parent`` symlink among the images), and installs only after the
trailer checked out; on any failure, cancellation and a truncated stream included, the staging directories go and
``TransferError`` is raised, so nothing is ever half-imported. Each export yields one frame per item; any re-chunking
of the bytes on the way imports the same.

Installing keeps the store's reference counting (``_snapstore.hold_layers``): the imported snapshot holds its directory
and its layers like one taken here, each directory of the memory chain is held by its child, and layers and parent
directories that the store holds already (an earlier import of the same chain) are shared, not installed twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import stat
import struct
import subprocess
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import msgspec

from .._exceptions import ImageError, InvalidValue, TransferError
from .._host import _snapstore, _tree, _userns
from .._images._image import Image, agent_layer
from .._workspace._core import PATH_MAX, WorkspaceSpec
from ._format import (
    CHUNK,
    FORMAT,
    FRAME,
    MAX_FRAME,
    MAX_HEADER,
    Header,
    SnapshotRecord,
    Trailer,
    TransferStats,
    header_dec,
    header_enc,
    pack_frame,
    trailer_dec,
)
from ._record import SnapshotRecord as SnapshotState
from ._snapshot import Snapshot, record_of

__all__ = ["FORMAT", "SnapshotRecord", "TransferStats", "export_snapshot", "import_snapshot", "snapshot_record"]

TAR = ["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "--format=posix"]
_ID = re.compile(r"^[0-9a-f]{8,64}$")


# ---------------------------------------------------------------------------------------------------- export


def _lower_tail(snap: SnapshotState) -> list[str]:
    """The part of the lower chain that is not snapshot layers: the agent layer and the image."""
    layers = {str(p) for p in _snapstore.chain_layers(snap.lower)}
    return [p for p in snap.lower.split(":") if p not in layers]


def snapshot_record(snap: Snapshot) -> SnapshotRecord:
    """The record of ``snap`` (blocking: reads its directories). Raises ``TransferError`` for a snapshot whose
    lower chain is not ``layers + agent layer + image`` (one copied past ``MAX_LAYERS`` is)."""
    rec = record_of(snap)
    tail = _lower_tail(rec)
    image_lower = _userns.lower_for(snap.image.lower_dirs, rec.spec.security.userns, create=False)
    if len(tail) < 2 or tail[1:] != image_lower.split(":"):  # an imported image is several layers
        raise TransferError(
            f"snapshot {snap.id}: its lower chain is not layers, agent layer and image; it cannot be exported",
            snapshot_id=snap.id,
        )
    mem: list[str] = []
    cur: Path | None = rec.path
    while cur is not None:
        if not cur.is_dir():
            raise TransferError(f"snapshot {snap.id}: directory {cur} is gone", snapshot_id=snap.id)
        mem.append(cur.name)
        cur = _snapstore.mem_parent_of(cur)
    return SnapshotRecord(
        id=snap.id,
        workspace_id=snap.workspace_id,
        mode=snap.mode,
        image_name=snap.image.name,
        image_digest=snap.image.digest,
        agent_layer=Path(tail[0]).parent.name,
        limits=rec.spec.limits,
        workdir=rec.spec.workdir,
        env=dict(rec.spec.env),
        hostname=rec.spec.hostname,
        max_output=rec.spec.max_output,
        fresh_net=rec.fresh_net,
        setup=list(rec.setup),
        layers=[p.name for p in _snapstore.chain_layers(rec.lower)],
        mem_chain=mem,
        user=rec.spec.user,
        security=rec.spec.security,
    )


async def export_snapshot(snap: Snapshot, *, chunk: int = CHUNK) -> AsyncIterator[bytes]:
    """The stream of ``snap`` (see the module doc), one frame per item. The snapshot stays usable; its directories
    and layers are held until the generator ends (close it, or exhaust it). Raises ``TransferError`` when ``snap``
    is closed or cannot be exported."""
    if snap.closed:
        raise TransferError(f"snapshot {snap.id} is closed", snapshot_id=snap.id)
    if not 1 <= chunk <= MAX_FRAME:
        raise InvalidValue(f"chunk must be 1..{MAX_FRAME} bytes", argument="chunk")
    await record_of(snap).materialize()  # its upper copy becomes its layer, which is what a copy mounts
    record = await anyio.to_thread.run_sync(snapshot_record, snap)
    user = f"export-{secrets.token_hex(4)}"
    held = [_snapstore.snapshot_dir() / d for d in record.mem_chain] + [
        _snapstore.layers_dir() / d for d in record.layers
    ]
    await anyio.to_thread.run_sync(_snapstore.hold_layers, held, user)
    try:
        await anyio.to_thread.run_sync(_check_extractable, record)
        seq = 0
        yield pack_frame(seq, b"H", header_enc.encode(Header(format=FORMAT, record=record, chunk=chunk)))
        digest, total = hashlib.sha256(), 0
        sections = [
            (b"S", _snapstore.snapshot_dir(), record.mem_chain, "snaps"),
            (b"L", _snapstore.layers_dir(), record.layers, "layers"),
        ]
        for kind, base, names, prefix in sections:
            # S: never the upper copy of a snapshot (a layer now, or a leftover of an unfinished materialisation)
            excludes = ["--anchored", *(f"--exclude={n}/upper" for n in names)] if kind == b"S" else []
            # --sparse: a file's holes travel as a map, not as zeros (a workspace's 1 TiB sparse file is its data)
            cmd = [*TAR, "--create", "--sparse", "--file=-", f"--transform=s,^,{prefix}/,S", *excludes, "-C", str(base),
                   *names]  # fmt: skip
            async for data in _tar_out(cmd, chunk, snap.id):
                digest.update(data)
                total += len(data)
                seq += 1
                yield pack_frame(seq, kind, data)
        seq += 1
        trailer = Trailer(data_bytes=total, data_sha256=digest.hexdigest(), frames=seq + 1)
        yield pack_frame(seq, b"T", header_enc.encode(trailer))
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_snapstore.release_layers, held, user)


def _check_extractable(record: SnapshotRecord) -> None:
    """Refuse to export a snapshot whose tree an import could not extract (blocking): GNU tar extracts each member
    by its whole name below the target directory (``layers/<id>/...``), which the kernel refuses past PATH_MAX, and a
    workspace may legally build trees deeper than that. Walked from descriptors, so any depth is measured."""
    sections = [
        (_snapstore.snapshot_dir(), record.mem_chain, "snaps"),
        (_snapstore.layers_dir(), record.layers, "layers"),
    ]
    for base, names, prefix in sections:
        for name in names:
            head = len(f"{prefix}/{name}/")
            for e in _tree.walk(base / name):
                if head + (e.depth + 1) * 256 < PATH_MAX:
                    continue  # no path of this depth can be too long: names are at most 255 bytes
                size = head + sum(len(os.fsencode(p)) + 1 for p in e.parents()) + len(os.fsencode(e.name))
                if size >= PATH_MAX:
                    where = "/".join(p[:40] for p in e.parents()[:3])  # names are the workspace's: cut short
                    raise TransferError(
                        f"snapshot {record.id}: cannot be exported: its tree holds a path of {size} bytes "
                        f"({where}/... {e.depth + 1} levels deep), deeper than the {PATH_MAX}-byte PATH_MAX an import "
                        "can extract (GNU tar extracts by path name); move or remove that tree in the workspace first",
                        snapshot_id=record.id,
                    )


async def _tar_out(cmd: list[str], chunk: int, snap_id: str) -> AsyncIterator[bytes]:
    errors = _Drain()
    try:
        proc = await anyio.open_process(cmd, stdout=-1, stderr=errors.write_fd)
    finally:
        errors.started()
    async with proc:
        assert proc.stdout is not None
        buf = bytearray()
        try:
            async for data in proc.stdout:
                buf += data
                while len(buf) >= chunk:
                    yield bytes(buf[:chunk])
                    del buf[:chunk]
            await proc.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                await errors.text()
            raise
        err = await errors.text()
        if proc.returncode:
            raise TransferError(f"snapshot {snap_id}: tar failed ({proc.returncode}): {err}", snapshot_id=snap_id)
        if buf:
            yield bytes(buf)


class _Drain(threading.Thread):
    """A child's stderr, read to its end in a thread, keeping the first ``keep`` bytes: a tar fed a hostile stream
    may write an error line per member (each with its path, unbounded), and a pipe nobody reads would stall it
    mid-extraction while we wait to send it more."""

    def __init__(self, keep: int = 16384) -> None:
        super().__init__(daemon=True)
        self.keep = keep
        self.data = bytearray()
        self.read_fd, self.write_fd = os.pipe2(os.O_CLOEXEC)

    def run(self) -> None:
        try:
            while chunk := os.read(self.read_fd, 65536):
                if len(self.data) < self.keep:
                    self.data += chunk[: self.keep - len(self.data)]
        finally:
            os.close(self.read_fd)

    def started(self) -> None:
        """The child has the pipe's write end (``write_fd``), or failed to start: close ours and read."""
        os.close(self.write_fd)
        self.write_fd = -1
        self.start()

    async def text(self, lines: int = 4, width: int = 240) -> str:
        """The start of what the child wrote, once it closed its stderr: its first ``lines`` lines, each cut to
        ``width`` characters (a line may hold a path a workspace made, of any length)."""
        await anyio.to_thread.run_sync(self.join)
        out = [
            line if len(line) <= width else f"{line[: width // 2]}...{line[-width // 2 :]}"
            for line in self.data.decode(errors="replace").strip().splitlines()[:lines]
        ]
        return "; ".join(out)


# ---------------------------------------------------------------------------------------------------- import


class _Reader:
    """Frames out of an iterable of byte strings of any size."""

    def __init__(self, source: AsyncIterable[bytes]) -> None:
        self._it = source.__aiter__()
        self._buf = bytearray()
        self.seq = 0

    async def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            try:
                data = await self._it.__anext__()
            except StopAsyncIteration:
                return False
            if not isinstance(data, bytes | bytearray | memoryview):
                raise TransferError(f"stream item is {type(data).__name__}, not bytes", snapshot_id="")
            self._buf += data
        return True

    async def frame(self, snap_id: str) -> tuple[bytes, bytes]:
        if not await self._fill(FRAME.size):
            raise TransferError(f"snapshot {snap_id}: the stream ended early (truncated)", snapshot_id=snap_id)
        kind, length, digest = FRAME.unpack_from(self._buf)
        if length > MAX_FRAME:
            raise TransferError(f"snapshot {snap_id}: frame {self.seq} is corrupt (length)", snapshot_id=snap_id)
        if not await self._fill(FRAME.size + length):
            raise TransferError(f"snapshot {snap_id}: the stream ended early (truncated)", snapshot_id=snap_id)
        payload = bytes(self._buf[FRAME.size : FRAME.size + length])
        del self._buf[: FRAME.size + length]
        if hashlib.sha256(struct.pack(">Q", self.seq) + kind + payload).digest() != digest:
            raise TransferError(
                f"snapshot {snap_id}: frame {self.seq} failed its sha256 check (corrupted, reordered or lost)",
                snapshot_id=snap_id,
            )
        self.seq += 1
        return kind, payload

    async def at_end(self) -> bool:
        return not self._buf and not await self._fill(1)


def _check_record(record: SnapshotRecord) -> None:
    bad = [n for n in [record.id, *record.layers, *record.mem_chain] if not _ID.match(n)]
    if bad or not _ID.match(record.agent_layer) or record.mem_chain[:1] != [record.id]:
        raise TransferError(f"snapshot {record.id!r}: malformed record", snapshot_id=str(record.id)[:64])
    if record.layers[:1] != [record.id] or len(set(record.layers)) != len(record.layers):
        raise TransferError(f"snapshot {record.id}: malformed layer chain", snapshot_id=record.id)
    if len(record.mem_chain) > _snapstore.MAX_MEM_CHAIN + 1 or len(set(record.mem_chain)) != len(record.mem_chain):
        raise TransferError(f"snapshot {record.id}: malformed memory chain", snapshot_id=record.id)
    if record.mode not in ("criu", "fs"):
        raise TransferError(f"snapshot {record.id}: unknown mode {record.mode!r}", snapshot_id=record.id)


def _local_image(record: SnapshotRecord, image: Image | None) -> tuple[Image, Path]:
    """The image and agent layer on this host that the record needs (blocking)."""
    if image is None:
        if record.image_name == "debian-bookworm":
            image = Image.base()
        elif record.image_name == "debian-bookworm-gui":
            image = Image.gui()
        else:
            raise ImageError(
                f"snapshot {record.id} needs image {record.image_name!r}: pass image= for images not built here",
                image=record.image_name,
            )
    if image.digest != record.image_digest:
        raise TransferError(
            f"snapshot {record.id}: image {image.name} here has digest {image.digest[:12]}, the snapshot's "
            f"{record.image_digest[:12]}; build the same image on both hosts",
            snapshot_id=record.id,
        )
    layer = agent_layer()
    if layer.parent.name != record.agent_layer:
        raise TransferError(
            f"snapshot {record.id}: agent layer {record.agent_layer} (another Bunshin version) is not this host's "
            f"{layer.parent.name}; run the same Bunshin version on both hosts",
            snapshot_id=record.id,
        )
    return image, layer


def _check_tree(root: Path, names: list[str], snaps: bool, snap_id: str) -> None:
    """Every entry of an extracted section is one the record names, and of an allowed type (blocking)."""

    def bad(why: str) -> TransferError:
        return TransferError(f"snapshot {snap_id}: rejected transfer: {why}", snapshot_id=snap_id)

    found = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if found != sorted(names):
        raise bad(f"entries {found} instead of {sorted(names)}")
    for e in _tree.walk(root):  # from descriptors: no depth limit, nothing followed
        st = e.st
        if e.depth == 0 and not stat.S_ISDIR(st.st_mode):  # a layer or snapshot that is a symlink: a host path
            raise bad(f"{e.name}: a {stat.filemode(st.st_mode)} instead of a directory")
        if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
            if snaps and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                raise bad(f"{e.shown()} is set-id")
            continue
        if snaps:
            if stat.S_ISLNK(st.st_mode) and e.name == "parent" and e.depth == 2 and e.parents()[1] == "images":
                target = os.readlink(e.name, dir_fd=e.dir_fd)
                m = re.fullmatch(r"\.\./\.\./([0-9a-f]+)/images", target)
                if m and m.group(1) in names and m.group(1) != e.parents()[0]:
                    continue
            raise bad(f"{e.shown()}: unexpected {stat.filemode(st.st_mode)} among snapshot images")
        if stat.S_ISLNK(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
            continue  # files of the workspace, as it had them (a symlink is never followed here)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            continue  # an overlay whiteout
        raise bad(f"{e.shown()}: device node {stat.filemode(st.st_mode)} in a layer")


class _Extract:
    """A ``tar --extract`` fed from the frames of one section, into ``dest``."""

    def __init__(self, dest: Path, snap_id: str) -> None:
        self.dest = dest
        self.snap_id = snap_id
        self.proc: anyio.abc.Process | None = None
        self.errors: _Drain | None = None

    async def feed(self, data: bytes) -> None:
        if self.proc is None:
            self.dest.mkdir(parents=True)
            cmd = [*TAR, "--extract", "--file=-", "--same-permissions", "--same-owner", "--no-overwrite-dir"]
            self.errors = _Drain()
            try:
                self.proc = await anyio.open_process(
                    [*cmd, "-C", str(self.dest)], stdout=subprocess.DEVNULL, stderr=self.errors.write_fd
                )
            finally:
                self.errors.started()
        assert self.proc.stdin is not None
        try:
            await self.proc.stdin.send(data)
        except (anyio.BrokenResourceError, OSError):
            await self.finish()  # tar quit: say why
            raise TransferError(f"snapshot {self.snap_id}: tar stopped reading", snapshot_id=self.snap_id) from None

    async def finish(self) -> None:
        if self.proc is None:
            self.dest.mkdir(parents=True, exist_ok=True)
            return
        proc, self.proc = self.proc, None
        assert proc.stdin is not None
        await proc.stdin.aclose()
        rc = await proc.wait()
        await proc.aclose()
        assert self.errors is not None
        err = await self.errors.text()
        if rc and "File name too long" in err:
            raise TransferError(
                f"snapshot {self.snap_id}: rejected transfer: the stream holds a path longer than the {PATH_MAX}-byte "
                f"PATH_MAX, which cannot be extracted (GNU tar extracts by path name): {err}",
                snapshot_id=self.snap_id,
            )
        if rc:
            raise TransferError(f"snapshot {self.snap_id}: tar could not extract: {err}", snapshot_id=self.snap_id)

    async def kill(self) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            with contextlib.suppress(ProcessLookupError):  # it exited already
                proc.kill()
            await proc.wait()
            await proc.aclose()
            assert self.errors is not None
            await self.errors.text()


async def import_snapshot(
    stream: AsyncIterable[bytes], *, image: Image | None = None, max_bytes: int = 256 << 30
) -> tuple[Snapshot, TransferStats]:
    """Import a stream made by ``export_snapshot`` into this host's snapshot store (``BUNSHIN_SNAPDIR``) and layers
    (``BUNSHIN_RUNDIR``/``BUNSHIN_HOME``): a ``Snapshot`` that ``Workspace.from_snapshot`` restores here, copies
    sharing its pages copy-on-write. The caller owns it (``aclose()``). ``image``: the local image the snapshot
    needs, when it is not the base or GUI image. Raises ``TransferError`` for a stream that is corrupt, truncated,
    over ``max_bytes`` of data, malformed, or for another image or Bunshin version; nothing is left behind then,
    nor when cancelled."""
    t0 = time.monotonic()
    reader = _Reader(stream)
    kind, payload = await reader.frame("?")
    if kind != b"H" or len(payload) > MAX_HEADER:
        raise TransferError("not a Bunshin snapshot stream (no header)", snapshot_id="")
    try:
        header = header_dec.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise TransferError(f"malformed snapshot stream header: {exc}", snapshot_id="") from exc
    record = header.record
    if header.format != FORMAT:
        raise TransferError(f"stream format {header.format!r}, expected {FORMAT!r}", snapshot_id=record.id)
    _check_record(record)
    local, layer = await anyio.to_thread.run_sync(_local_image, record, image)
    token = secrets.token_hex(6)
    snap_stage = _snapstore.snapshot_dir() / f"import-{token}.partial"
    layer_stage = _snapstore.layers_dir() / f"import-{token}.partial"
    stages = [snap_stage, layer_stage]
    # ``bunshin gc`` keeps a ``.partial`` whose users (``import-<token>.users``) are alive.
    await anyio.to_thread.run_sync(_snapstore.hold_layers, [s.with_suffix("") for s in stages], "import")
    sections = {b"S": _Extract(snap_stage / "s", record.id), b"L": _Extract(layer_stage / "l", record.id)}
    try:
        digest, total, order = hashlib.sha256(), 0, [b"S", b"L"]
        while True:
            kind, payload = await reader.frame(record.id)
            if kind == b"T":
                break
            if kind not in order:
                raise TransferError(f"snapshot {record.id}: unexpected frame {kind!r}", snapshot_id=record.id)
            while order[0] != kind:  # the S section ended
                await sections[order.pop(0)].finish()
            total += len(payload)
            if total > max_bytes:
                raise TransferError(f"snapshot {record.id}: more than {max_bytes} bytes", snapshot_id=record.id)
            digest.update(payload)
            await sections[kind].feed(payload)
        try:
            trailer = trailer_dec.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise TransferError(f"snapshot {record.id}: malformed trailer", snapshot_id=record.id) from exc
        if (trailer.data_bytes, trailer.data_sha256, trailer.frames) != (total, digest.hexdigest(), reader.seq):
            raise TransferError(f"snapshot {record.id}: the data does not match its trailer", snapshot_id=record.id)
        if not await reader.at_end():
            raise TransferError(f"snapshot {record.id}: bytes after the trailer", snapshot_id=record.id)
        for kind in order:
            await sections[kind].finish()
        await anyio.to_thread.run_sync(_check_tree, snap_stage / "s" / "snaps", record.mem_chain, True, record.id)
        await anyio.to_thread.run_sync(_check_tree, layer_stage / "l" / "layers", record.layers, False, record.id)
        snap = await anyio.to_thread.run_sync(_install, record, local, layer, snap_stage, layer_stage)
    except BaseException:
        with anyio.CancelScope(shield=True):
            for section in sections.values():
                await section.kill()
        raise
    finally:
        with anyio.CancelScope(shield=True):
            for stage in stages:
                await anyio.to_thread.run_sync(_tree.discard, stage)
            await anyio.to_thread.run_sync(_snapstore.release_layers, [s.with_suffix("") for s in stages], "import")
    return snap, TransferStats(snapshot_id=snap.id, source_id=record.id, bytes=total, seconds=time.monotonic() - t0)


def _install(record: SnapshotRecord, image: Image, agent: Path, snap_stage: Path, layer_stage: Path) -> Snapshot:
    """Move the checked staging trees into place and take the references (blocking). The top snapshot gets a new
    id when the store has its id already (the same stream imported twice); the rest of its chains is shared with
    what the store holds."""
    snaps, layers = _snapstore.snapshot_dir(), _snapstore.layers_dir()
    base_lower = _userns.lower_for(f"{agent}:{image.lower_dirs}", record.security.userns)
    with _snapstore.store_lock():  # the entries placed and held at once for a collection elsewhere (``bunshin gc``)
        new_id = record.id
        if (snaps / new_id).exists() or (layers / new_id).exists():
            new_id = secrets.token_hex(6)
        mem = [new_id, *record.mem_chain[1:]]
        lays = [new_id, *record.layers[1:]]
        placed: list[Path] = []
        try:
            for src_name, dst in zip(record.mem_chain, mem, strict=True):
                if not (snaps / dst).exists():
                    (snap_stage / "s" / "snaps" / src_name).rename(snaps / dst)
                    placed.append(snaps / dst)
            for src_name, dst in zip(record.layers, lays, strict=True):
                if not (layers / dst).exists():
                    (layer_stage / "l" / "layers" / src_name).rename(layers / dst)
                    placed.append(layers / dst)
            for child, parent in zip(mem, mem[1:], strict=False):
                _snapstore.hold_layers([snaps / parent], f"child-{child}")
            snap = Snapshot.adopt(
                new_id,
                workspace_id=record.workspace_id,
                lower=":".join([*(str(layers / n) for n in lays), base_lower]),
                spec=WorkspaceSpec(
                    image,
                    limits=record.limits,
                    security=record.security,
                    workdir=record.workdir,
                    env=dict(record.env),
                    hostname=record.hostname,
                    max_output=record.max_output,
                    user=record.user,
                ),
                mode=record.mode,
                setup=list(record.setup),
                fresh_net=record.fresh_net,
            )
            rec = record_of(snap)
            _snapstore.hold_layers([rec.path, *_snapstore.chain_layers(rec.lower)], rec.holder)
        except BaseException:
            for path in placed:
                _tree.discard(path)
            raise
    return snap
