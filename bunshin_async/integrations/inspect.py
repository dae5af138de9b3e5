"""inspect-ai (``pip install 'bunshin[inspect]'``): the ``bunshin`` sandbox provider, registered through the package's
``inspect_ai`` entry point. See ``bunshin_async.integrations._inspect``::

    Task(dataset=..., solver=..., scorer=..., sandbox="bunshin")
    Task(..., sandbox=("bunshin", "my-task:latest"))      # a Bunshin or local Docker image, or a Dockerfile's path
"""

from __future__ import annotations

from .._public import publish as _publish
from ._inspect import BunshinSandboxConfig, BunshinSandboxEnvironment

__all__ = ["BunshinSandboxConfig", "BunshinSandboxEnvironment"]

_publish(__name__, globals())
