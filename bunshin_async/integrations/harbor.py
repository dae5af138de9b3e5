"""Harbor (``pip install 'bunshin[harbor]'``, Python >= 3.12): ``BunshinEnvironment``, a Harbor environment on a
Bunshin workspace, importable by path. See ``bunshin_async.integrations._harbor``::

    harbor run -p tasks/my-task --env bunshin_async.integrations.harbor:BunshinEnvironment -a oracle
"""

from __future__ import annotations

from .._public import publish as _publish
from ._harbor import BunshinEnvironment

__all__ = ["BunshinEnvironment"]

_publish(__name__, globals())
