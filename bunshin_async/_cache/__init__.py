"""The tool prefix cache (private; the public names are re-exported by ``bunshin_async.cache``).

Layout: ``_keys`` (state-chain keys), ``_records`` (stored records and their checksums), ``_store`` (the store
interface, in-memory and layered stores), ``_sqlite`` and ``_redis`` (the on-disk and shared stores), ``_state``
(snapshot refs, the ``StateProvider`` protocol and the prefix tree of states), ``_flight`` (single flight),
``_metrics`` and ``_cache`` (``ToolCache`` and ``CachedSession``).
"""
