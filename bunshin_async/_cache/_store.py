"""The store interface and the in-process stores.

A store maps 16-byte keys to opaque values (sealed records, see ``_records``). It does not interpret them: checksum
verification and the decision to delete a corrupt value belong to the cache. Every method is safe to call
concurrently from tasks of one event loop. ``StoreUnavailable`` is the one error a store raises on purpose; a
store that can degrade (Redis) does so itself and reports it in ``stats().available``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import msgspec

from .._exceptions import InvalidValue, StoreUnavailable


class CacheWarning(UserWarning):
    """The cache degraded (a shared store became unreachable); it keeps working on its local stores."""


class StoreStats(msgspec.Struct, kw_only=True):
    """Counters of one store. ``bytes``/``entries`` are what the store holds (an estimate for shared stores)."""

    name: str
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    deletes: int = 0
    evictions: int = 0
    errors: int = 0
    available: bool = True
    layers: list[StoreStats] = msgspec.field(default_factory=list)


class Store(Protocol):
    """What the cache needs from a store."""

    name: str

    async def get(self, key: bytes) -> bytes | None: ...

    async def put(self, key: bytes, value: bytes) -> None: ...

    async def delete(self, key: bytes) -> None: ...

    def stats(self) -> StoreStats: ...

    async def aclose(self) -> None: ...


class MemoryStore:
    """A bounded LRU in this process. ``max_bytes`` counts keys and values; a value larger than the budget is not
    stored at all."""

    def __init__(self, max_bytes: int = 64 << 20, *, name: str = "memory") -> None:
        if max_bytes <= 0:
            raise InvalidValue("max_bytes must be positive", argument="max_bytes")
        self.name = name
        self.max_bytes = max_bytes
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._stats = StoreStats(name=name)

    async def get(self, key: bytes) -> bytes | None:
        return self.get_nowait(key)

    def get_nowait(self, key: bytes) -> bytes | None:
        value = self._data.get(key)
        if value is None:
            self._stats.misses += 1
            return None
        self._data.move_to_end(key)
        self._stats.hits += 1
        return value

    async def put(self, key: bytes, value: bytes) -> None:
        size = len(key) + len(value)
        if size > self.max_bytes:
            return
        old = self._data.pop(key, None)
        if old is not None:
            self._stats.bytes -= len(key) + len(old)
        self._data[key] = value
        self._stats.bytes += size
        self._stats.puts += 1
        while self._stats.bytes > self.max_bytes:
            k, v = self._data.popitem(last=False)
            self._stats.bytes -= len(k) + len(v)
            self._stats.evictions += 1

    async def delete(self, key: bytes) -> None:
        old = self._data.pop(key, None)
        if old is not None:
            self._stats.bytes -= len(key) + len(old)
            self._stats.deletes += 1

    def stats(self) -> StoreStats:
        self._stats.entries = len(self._data)
        return msgspec.structs.replace(self._stats)

    async def aclose(self) -> None:
        self._data.clear()
        self._stats.bytes = 0

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` is stored, without counting a lookup or touching the LRU order."""
        return key in self._data

    # Test hook: the raw value, to corrupt it in place.
    def _raw(self) -> OrderedDict[bytes, bytes]:
        return self._data


class LayeredStore:
    """Stores in front of each other, fastest first (memory, then SQLite or Redis). A hit in a lower layer is
    copied into the layers above it; puts and deletes go to every layer. A layer raising ``StoreUnavailable`` is
    skipped for that operation."""

    def __init__(self, *layers: Store, name: str = "layered") -> None:
        if not layers:
            raise InvalidValue("a layered store needs at least one layer", argument="layers")
        self.name = name
        self.layers: Sequence[Store] = layers
        self._stats = StoreStats(name=name)

    async def get(self, key: bytes) -> bytes | None:
        for i, layer in enumerate(self.layers):
            try:
                value = await layer.get(key)
            except StoreUnavailable:
                self._stats.errors += 1
                continue
            if value is not None:
                for upper in self.layers[:i]:
                    try:
                        await upper.put(key, value)
                    except StoreUnavailable:
                        self._stats.errors += 1
                self._stats.hits += 1
                return value
        self._stats.misses += 1
        return None

    async def put(self, key: bytes, value: bytes) -> None:
        self._stats.puts += 1
        for layer in self.layers:
            try:
                await layer.put(key, value)
            except StoreUnavailable:
                self._stats.errors += 1

    async def delete(self, key: bytes) -> None:
        self._stats.deletes += 1
        for layer in self.layers:
            try:
                await layer.delete(key)
            except StoreUnavailable:
                self._stats.errors += 1

    def stats(self) -> StoreStats:
        layers = [layer.stats() for layer in self.layers]
        return msgspec.structs.replace(
            self._stats,
            entries=max((s.entries for s in layers), default=0),
            bytes=sum(s.bytes for s in layers),
            available=all(s.available for s in layers),
            layers=layers,
        )

    async def aclose(self) -> None:
        for layer in self.layers:
            await layer.aclose()
