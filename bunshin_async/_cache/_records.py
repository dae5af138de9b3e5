"""What the stores hold: a checksummed envelope around one cache entry.

A record is ``Envelope(schema, checksum, body)`` encoded with msgpack; ``body`` is the encoded ``Entry`` and the
checksum is ``xxh3_64(key + body)``, so a flipped byte, a truncated value or a value stored under the wrong key
is detected and treated as a miss.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import xxhash

from .._exceptions import FileNotFound, InvalidArgument, PathOutsideWorkspace, ToolError
from ._keys import SCHEMA_VERSION


class SnapshotRef(msgspec.Struct, frozen=True):
    """An opaque handle on a captured workspace state. ``id`` means something to the ``StateProvider`` that made
    it only; ``size`` (bytes) counts against the snapshot budget."""

    id: str
    size: int = 0


class ErrorRecord(msgspec.Struct, frozen=True):
    """A deterministic tool failure (``FileNotFound`` and friends), replayed as the same exception on a hit."""

    kind: str
    message: str
    path: str | None = None


class Entry(msgspec.Struct, frozen=True):
    """One cached call. ``result`` is the tool's result encoded as its ``result_type``; ``duration`` is what the
    call took when it ran (seconds); ``snapshot`` is the state after a ``write`` call, when one was captured, and
    ``pids`` how far that call moved its workspace's pid cursor (None: not known), so that a rollout restored from
    the snapshot continues its own pid sequence by as much, not the sibling's that ran it."""

    tool: str
    effect: str
    result: bytes | None
    duration: float
    created: float
    error: ErrorRecord | None = None
    snapshot: SnapshotRef | None = None
    pids: int | None = None


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    schema: int
    checksum: int
    body: bytes


class CorruptRecord(Exception):
    """Internal: a stored value failed its checks. Never escapes the cache (it becomes a miss)."""


_entry_encoder = msgspec.msgpack.Encoder()
_entry_decoder = msgspec.msgpack.Decoder(Entry)
_env_encoder = msgspec.msgpack.Encoder()
_env_decoder = msgspec.msgpack.Decoder(Envelope)


def _checksum(key: bytes, body: bytes) -> int:
    return int(xxhash.xxh3_64_intdigest(key + body))


def seal(key: bytes, entry: Entry) -> bytes:
    body = _entry_encoder.encode(entry)
    return _env_encoder.encode(Envelope(SCHEMA_VERSION, _checksum(key, body), body))


def unseal(key: bytes, value: bytes) -> Entry:
    """Decode and verify a stored value; raises ``CorruptRecord``."""
    try:
        env = _env_decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise CorruptRecord(f"undecodable envelope: {exc}") from exc
    if env.schema != SCHEMA_VERSION:
        raise CorruptRecord(f"schema {env.schema}, expected {SCHEMA_VERSION}")
    if _checksum(key, env.body) != env.checksum:
        raise CorruptRecord("checksum mismatch")
    try:
        return _entry_decoder.decode(env.body)
    except msgspec.DecodeError as exc:
        raise CorruptRecord(f"undecodable entry: {exc}") from exc


# Only failures that are a function of the call and the state are cached; a timeout or an OS error is not.
_CACHEABLE_ERRORS: dict[str, type[ToolError]] = {
    "FileNotFound": FileNotFound,
    "PathOutsideWorkspace": PathOutsideWorkspace,
    "InvalidArgument": InvalidArgument,
}


def error_record(exc: BaseException) -> ErrorRecord | None:
    name = type(exc).__name__
    if isinstance(exc, ToolError) and _CACHEABLE_ERRORS.get(name) is type(exc):
        return ErrorRecord(name, exc.message, getattr(exc, "path", None))
    return None


def rebuild_error(rec: ErrorRecord, tool: str) -> ToolError:
    cls = _CACHEABLE_ERRORS.get(rec.kind)
    if cls is None:
        raise CorruptRecord(f"unknown error kind {rec.kind!r}")
    if cls is InvalidArgument:
        return InvalidArgument(rec.message, tool=tool)
    kwargs: dict[str, Any] = {"tool": tool, "path": rec.path or ""}
    return cls(rec.message, **kwargs)


_result_encoder = msgspec.msgpack.Encoder()


def entry_of(tool: str, effect: str, outcome: Any, duration: float) -> Entry | None:
    """The entry recording a call's ``outcome`` (its result, or the ``ToolError`` it raised) and run time
    (seconds); None when it may not be cached (an error that is not a function of the call and the state, or a
    result msgpack cannot encode)."""
    if isinstance(outcome, ToolError):
        rec = error_record(outcome)
        return None if rec is None else Entry(tool, effect, None, duration, time.time(), error=rec)
    try:
        raw = _result_encoder.encode(outcome)
    except (TypeError, msgspec.EncodeError):
        return None
    return Entry(tool, effect, raw, duration, time.time())


def outcome_of(entry: Entry, decoder: msgspec.msgpack.Decoder[Any], tool: str) -> Any:
    """The result an entry holds (decoded by the tool's ``decoder``), or the ``ToolError`` to raise; raises
    ``CorruptRecord``."""
    if entry.error is not None:
        return rebuild_error(entry.error, tool)
    if entry.result is None:
        raise CorruptRecord("entry without a result")
    try:
        return decoder.decode(entry.result)
    except msgspec.DecodeError as exc:  # the tool's result type changed without a version bump
        raise CorruptRecord(str(exc)) from exc
