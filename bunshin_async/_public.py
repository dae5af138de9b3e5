"""Re-exported names carry the public module they are imported from (httpx's and trio's ``fixup_module_metadata``),
so reprs, docs, pickles and error messages name ``bunshin_async.tools.Tool``, not ``bunshin_async._tools.Tool``."""

from __future__ import annotations

import inspect
import sys
from typing import Any


def publish(module: str, namespace: dict[str, Any]) -> None:
    """Set ``__module__`` of every class and function in ``namespace["__all__"]`` to ``module``; call it at the end
    of each public module as ``publish(__name__, globals())``. Constants and type aliases are left as they are.

    A class's string annotations (``from __future__ import annotations``) are evaluated in its defining module
    first: ``typing.get_type_hints`` and msgspec look them up in ``sys.modules[cls.__module__]``, where the public
    module lacks the private one's imports."""
    package = module.partition(".")[0]
    for name in namespace["__all__"]:
        obj = namespace[name]
        if not (isinstance(obj, type) or inspect.isfunction(obj)) or not obj.__module__.startswith(package):
            continue
        if isinstance(obj, type) and obj.__module__ != module:
            globs = vars(sys.modules[obj.__module__])
            annotations = obj.__dict__.get("__annotations__", {})
            for field, value in annotations.items():
                if isinstance(value, str):
                    try:
                        annotations[field] = eval(value, globs, dict(vars(obj)))  # noqa: S307 - our own source
                    except NameError:  # a name imported only under TYPE_CHECKING stays a string
                        pass
        obj.__module__ = module
