"""The tool prefix cache: serve tool calls that sibling rollouts already made from the same workspace state.

::

    from bunshin_async.cache import CachedSession, LayeredStore, MemoryStore, SqliteStore, ToolCache

    store = LayeredStore(MemoryStore(), SqliteStore("/var/cache/bunshin/tools.db"))
    async with ToolCache(store, ForkStateProvider()) as cache:
        async with Workspace() as ws, cache.session(ws) as session:
            result = await session.call("bash", {"command": "ls -la"})
            session.workspace  # a write hit continues in a fork: the current workspace

Tools and their effect classes are ``bunshin_async.tools``; see ``bunshin_async._cache._cache`` for what is
served and when.
"""

from __future__ import annotations

from ._cache._cache import CachedSession, ToolCache
from ._cache._calls import CallRecord
from ._cache._keys import SCHEMA_VERSION
from ._cache._metrics import AuditMismatch, CacheMetrics, ToolStats
from ._cache._redis import RedisStore
from ._cache._sqlite import SqliteStore
from ._cache._state import ForkStateProvider, SnapshotRef, StateProvider
from ._cache._store import CacheWarning, LayeredStore, MemoryStore, Store, StoreStats
from ._public import publish as _publish

__all__ = [
    "SCHEMA_VERSION",
    "AuditMismatch",
    "CacheMetrics",
    "CacheWarning",
    "CachedSession",
    "CallRecord",
    "ForkStateProvider",
    "LayeredStore",
    "MemoryStore",
    "RedisStore",
    "SnapshotRef",
    "SqliteStore",
    "StateProvider",
    "Store",
    "StoreStats",
    "ToolCache",
    "ToolStats",
]

_publish(__name__, globals())
