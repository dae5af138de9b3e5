"""The shared store: Redis (``redis.asyncio``), so rollouts on several machines share results.

Redis being unreachable is not an error: the store answers misses and queues puts (up to ``backlog_bytes``)
while it is down, warns once per outage (``CacheWarning``), probes again every ``retry_interval`` seconds, and on
reconnect writes the queued puts and deletes. The budget for Redis is the server's: run it with ``maxmemory`` and
``maxmemory-policy allkeys-lru`` (and ``appendonly yes`` to keep entries across a restart); ``ttl`` expires
entries on top of that.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from .._exceptions import StoreUnavailable
from ._store import CacheWarning, StoreStats

T = TypeVar("T")
log = logging.getLogger("bunshin.cache")


class RedisStore:
    """Entries under ``prefix`` in the Redis at ``url``."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: bytes = b"bunshin:cache:",
        ttl: float | None = None,
        socket_timeout: float = 1.0,
        retry_interval: float = 1.0,
        backlog_bytes: int = 16 << 20,
        name: str = "redis",
    ) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError as exc:  # an optional dependency (``pip install bunshin[redis]``)
            raise StoreUnavailable("redis is not installed; `pip install 'bunshin[redis]'`", store=name) from exc
        import redis.exceptions as rexc

        self.name = name
        self.url = url
        self.prefix = prefix
        self.ttl_ms = None if ttl is None else int(ttl * 1000)
        self.retry_interval = retry_interval
        self.backlog_bytes = backlog_bytes
        # No client-side retries: an outage is handled here, once, instead of stalling every call.
        self._client: Any = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
        )
        self._outage_errors: tuple[type[BaseException], ...] = (
            rexc.ConnectionError,
            rexc.TimeoutError,
            rexc.BusyLoadingError,
            OSError,
        )
        self._redis_error: type[BaseException] = rexc.RedisError
        self._down = False
        self._next_probe = 0.0
        self._backlog: OrderedDict[bytes, bytes | None] = OrderedDict()  # None: a queued delete
        self._backlog_size = 0
        self._stats = StoreStats(name=name)
        self._closed = False

    @property
    def available(self) -> bool:
        return not self._down

    def _mark_down(self, exc: BaseException) -> None:
        self._stats.errors += 1
        self._next_probe = time.monotonic() + self.retry_interval
        if self._down:
            return
        self._down = True
        self._stats.available = False
        # Mark first, then warn: with warnings turned into errors the store must already be degraded.
        warnings.warn(
            f"Redis cache store {self.url} is unreachable ({exc}); using local stores until it is back",
            CacheWarning,
            stacklevel=4,
        )

    async def _mark_up(self) -> None:
        self._down = False
        self._stats.available = True
        log.info("Redis cache store %s is reachable again", self.url)
        await self._flush_backlog()

    async def _do(self, op: Callable[[], Awaitable[T]], fallback: T) -> T:
        if self._closed:
            raise StoreUnavailable(f"Redis store {self.url} is closed", store=self.name)
        if self._down and time.monotonic() < self._next_probe:
            return fallback
        for attempt in (0, 1):
            try:
                result = await op()
            except self._outage_errors as exc:
                # A pooled connection may be stale after a server restart: one fresh try before calling it down.
                if attempt == 0 and not self._down:
                    continue
                self._mark_down(exc)
                return fallback
            except self._redis_error as exc:  # e.g. OOM with a noeviction policy: a miss, not an outage
                self._stats.errors += 1
                log.debug("Redis cache store %s: %s", self.url, exc)
                return fallback
            if self._down:
                await self._mark_up()
            return result
        return fallback  # pragma: no cover

    async def get(self, key: bytes) -> bytes | None:
        if self._down and key in self._backlog:
            return self._backlog[key]
        value: bytes | None = await self._do(lambda: self._client.get(self.prefix + key), None)
        if value is None:
            self._stats.misses += 1
        else:
            self._stats.hits += 1
        return value

    async def put(self, key: bytes, value: bytes) -> None:
        ok = await self._do(lambda: self._client.set(self.prefix + key, value, px=self.ttl_ms), False)
        if ok:
            self._stats.puts += 1
            self._stats.entries += 1
            self._stats.bytes += len(key) + len(value)
        else:
            self._queue(key, value)

    async def delete(self, key: bytes) -> None:
        n = await self._do(lambda: self._client.delete(self.prefix + key), None)
        if n is None:
            self._queue(key, None)
        elif n:
            self._stats.deletes += 1

    def _queue(self, key: bytes, value: bytes | None) -> None:
        old = self._backlog.pop(key, None)
        if old is not None:
            self._backlog_size -= len(old)
        self._backlog[key] = value
        self._backlog_size += len(key) + (len(value) if value is not None else 0)
        while self._backlog_size > self.backlog_bytes and self._backlog:
            k, v = self._backlog.popitem(last=False)
            self._backlog_size -= len(k) + (len(v) if v is not None else 0)

    async def _flush_backlog(self) -> None:
        backlog, self._backlog, self._backlog_size = self._backlog, OrderedDict(), 0
        if not backlog:
            return
        pipe = self._client.pipeline(transaction=False)
        for key, value in backlog.items():
            if value is None:
                pipe.delete(self.prefix + key)
            else:
                pipe.set(self.prefix + key, value, px=self.ttl_ms)
        try:
            await pipe.execute()
        except self._outage_errors as exc:
            self._backlog = backlog
            self._backlog_size = sum(len(k) + len(v or b"") for k, v in backlog.items())
            self._mark_down(exc)
            return
        self._stats.puts += sum(v is not None for v in backlog.values())
        log.info("Redis cache store %s: wrote %d queued entries", self.url, len(backlog))

    def stats(self) -> StoreStats:
        return msgspec.structs.replace(self._stats)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._client.aclose()
        except self._outage_errors:
            pass

    async def ping(self) -> bool:
        """True if Redis answers now (a probe outside the retry schedule)."""
        self._next_probe = 0.0
        return bool(await self._do(lambda: self._client.ping(), False))
