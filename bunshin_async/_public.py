"""Re-exported names carry their public module (httpx's and trio's ``fixup_module_metadata``): reprs, docs and
pickles say ``bunshin_async.tools.Tool``, not ``bunshin_async._tools._tools.Tool``."""

from __future__ import annotations

import inspect
import sys
from typing import Any


def publish(module: str, namespace: dict[str, Any]) -> None:
    """Set ``__module__`` of the classes and functions in ``namespace["__all__"]`` to ``module`` (the end of each
    public module calls ``publish(__name__, globals())``). A class's string annotations are evaluated in its
    defining module first: msgspec and ``typing.get_type_hints`` resolve them in ``sys.modules[cls.__module__]``."""
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
