"""The snapshot stream's format (the module doc of ``_transfer`` draws it): its version, frame size bounds, the
framing with its digest, and the record, header and trailer every export writes and every import checks."""

from __future__ import annotations

import hashlib
import struct

import msgspec

from .._host._kernel import Limits
from .._host._security import Security
from .._workspace._core import SetupStep

FORMAT = "bunshin-snapshot/1"
CHUNK = 4 << 20
"""Bytes of tar data per frame (4 MiB: big enough that framing costs nothing, small enough for an object store)."""
MAX_FRAME = 64 << 20
"""A frame announcing more than this is corrupt (its length field is)."""
MAX_HEADER = 1 << 20
FRAME = struct.Struct(">cI32s")


class SnapshotRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a ``Snapshot`` object knows that its directories do not: what ``from_snapshot`` needs to make
    copies. ``layers``: the snapshot's layer chain, its own first; ``mem_chain``: the snapshot directories its
    memory images need, its own first, then each parent. ``agent_layer`` is the agent layer's version (its
    directory name), which the importing host must have."""

    id: str
    workspace_id: str
    mode: str
    image_name: str
    image_digest: str
    agent_layer: str
    limits: Limits
    workdir: str
    env: dict[str, str]
    hostname: str
    max_output: int
    fresh_net: bool
    setup: list[tuple[SetupStep, int]]
    layers: list[str]
    mem_chain: list[str]
    user: str | None = None
    security: Security = Security()


class Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    record: SnapshotRecord
    chunk: int


class Trailer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    data_bytes: int
    data_sha256: str
    frames: int


class TransferStats(msgspec.Struct):
    """What an import measured: ``bytes`` of tar data, ``seconds`` from the first frame to the installed snapshot."""

    snapshot_id: str
    source_id: str
    bytes: int
    seconds: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


header_enc = msgspec.json.Encoder(order="deterministic")
header_dec = msgspec.json.Decoder(Header)
trailer_dec = msgspec.json.Decoder(Trailer)


def pack_frame(seq: int, kind: bytes, payload: bytes) -> bytes:
    digest = hashlib.sha256(struct.pack(">Q", seq) + kind + payload).digest()
    return FRAME.pack(kind, len(payload), digest) + payload
