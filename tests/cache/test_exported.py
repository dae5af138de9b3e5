"""``bunshin_async.cache`` exports exactly its ``__all__`` (anyio's test_all_attributes)."""

from __future__ import annotations

import bunshin_async.cache as cache


def test_all_is_exported_and_public() -> None:
    exported = {name for name in dir(cache) if not name.startswith("_")} - {"annotations"}
    assert set(cache.__all__) == exported
    for name in cache.__all__:
        obj = getattr(cache, name)
        if name != "SCHEMA_VERSION":
            assert obj.__module__.startswith("bunshin_async"), name
