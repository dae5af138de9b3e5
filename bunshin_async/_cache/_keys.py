"""Cache keys: a chain of ``xxh3_128`` digests over deterministically encoded calls.

The state chain starts at the workspace's base state (schema version, image digest, workdir, environment, output
cap, a caller salt and the setup calls) and is extended by every ``write`` call. A ``read`` call's key is the
current state extended by the call, without advancing it; a ``pure`` call's key is the call alone. Each extension
is ``h.copy()`` plus one ``update``, so keying costs O(size of the call), not O(length of the rollout).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec
import xxhash

#: Bumped whenever keys or records change meaning; part of every root and every record.
SCHEMA_VERSION = 1

_encoder = msgspec.msgpack.Encoder(order="deterministic")

# One-byte domain tags, so a root, a write, a read and a pure call can never produce the same hash input.
_ROOT, _WRITE, _READ, _PURE, _TAINT = b"S", b"W", b"R", b"P", b"T"


class BaseState(msgspec.Struct, frozen=True, array_like=True):
    schema: int
    image: str
    workdir: str
    env: dict[str, str]
    max_output: int
    salt: str


class CallForm(msgspec.Struct, frozen=True, array_like=True):
    """The canonical form of a call: what identifies it in a key."""

    tool: str
    version: str
    args: dict[str, Any]


def encode_call(tool: str, version: str, args: Mapping[str, Any]) -> bytes:
    return _encoder.encode(CallForm(tool, version, dict(args)))


class StateChain:
    """The running digest of one rollout's workspace state. Cheap to copy (``fork``)."""

    __slots__ = ("_h",)

    def __init__(self, h: Any) -> None:
        self._h = h

    @classmethod
    def root(cls, base: BaseState) -> StateChain:
        h = xxhash.xxh3_128()
        h.update(_ROOT + _encoder.encode(base))
        return cls(h)

    @property
    def key(self) -> bytes:
        """The 16-byte digest naming the current state."""
        return bytes(self._h.digest())

    def fork(self) -> StateChain:
        return StateChain(self._h.copy())

    def read_key(self, call: bytes) -> bytes:
        h = self._h.copy()
        h.update(_READ + call)
        return bytes(h.digest())

    def write_key(self, call: bytes) -> bytes:
        """The key of a write call at this state; it is also the name of the state after the call."""
        h = self._h.copy()
        h.update(_WRITE + call)
        return bytes(h.digest())

    def advance(self, call: bytes) -> None:
        self._h.update(_WRITE + call)

    def taint(self) -> None:
        """Move to a state no other rollout can name: after a call whose effect is not a function of the call
        (a nondeterministic write, a timeout, an external call)."""
        self._h.update(_TAINT + os.urandom(16))


def pure_key(call: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(_PURE + SCHEMA_VERSION.to_bytes(4, "big") + call)
    return bytes(h.digest())
