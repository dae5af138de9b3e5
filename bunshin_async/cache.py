"""The tool prefix cache: serve tool calls that sibling rollouts already made from the same workspace state.

::

    from bunshin_async.cache import CachedSession, LayeredStore, MemoryStore, SqliteStore, ToolCache

    store = LayeredStore(MemoryStore(), SqliteStore("/var/cache/bunshin/tools.db"))
    async with ToolCache(store, ForkStateProvider()) as cache:
        async with Workspace() as ws, cache.session(ws) as session:
            result = await session.call("bash", {"command": "ls -la"})
            session.workspace  # a write hit continues in a fork: the current workspace

See ``bunshin_async._cache._cache`` for what is served and when.
"""

from __future__ import annotations

from ._cache._cache import CachedSession as CachedSession
from ._cache._cache import CallRecord as CallRecord
from ._cache._cache import ToolCache as ToolCache
from ._cache._keys import SCHEMA_VERSION as SCHEMA_VERSION
from ._cache._metrics import AuditMismatch as AuditMismatch
from ._cache._metrics import CacheMetrics as CacheMetrics
from ._cache._metrics import ToolStats as ToolStats
from ._cache._redis import RedisStore as RedisStore
from ._cache._sqlite import SqliteStore as SqliteStore
from ._cache._state import ForkStateProvider as ForkStateProvider
from ._cache._state import SnapshotRef as SnapshotRef
from ._cache._state import StateProvider as StateProvider
from ._cache._store import CacheWarning as CacheWarning
from ._cache._store import LayeredStore as LayeredStore
from ._cache._store import MemoryStore as MemoryStore
from ._cache._store import Store as Store
from ._cache._store import StoreStats as StoreStats
from ._tools import CallClass as CallClass
from ._tools import Effect as Effect
from ._tools import Tool as Tool
from ._tools import bash_tool as bash_tool
from ._tools import builtin_tools as builtin_tools
from ._tools import classify_command as classify_command
from ._tools import list_dir_tool as list_dir_tool
from ._tools import python_tool as python_tool
from ._tools import read_file_tool as read_file_tool
from ._tools import write_file_tool as write_file_tool

__all__ = [
    "SCHEMA_VERSION",
    "AuditMismatch",
    "CacheMetrics",
    "CacheWarning",
    "CachedSession",
    "CallClass",
    "CallRecord",
    "Effect",
    "ForkStateProvider",
    "LayeredStore",
    "MemoryStore",
    "RedisStore",
    "SnapshotRef",
    "SqliteStore",
    "StateProvider",
    "Store",
    "StoreStats",
    "Tool",
    "ToolCache",
    "ToolStats",
    "bash_tool",
    "builtin_tools",
    "classify_command",
    "list_dir_tool",
    "python_tool",
    "read_file_tool",
    "write_file_tool",
]
