"""Importing an optional framework with an error that says which extra installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

from .._exceptions import CapabilityMissing


def require(module: str, *, framework: str, extra: str) -> ModuleType:
    """``import module``, or ``CapabilityMissing`` telling the caller to install ``bunshin[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CapabilityMissing(
            f"{framework} is not installed ({exc})", capability=module, remedy=f"pip install 'bunshin[{extra}]'"
        ) from exc
