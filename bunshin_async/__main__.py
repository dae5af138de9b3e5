"""``python -m bunshin_async ...`` is the ``bunshin`` command (``python -m bunshin_async setup`` sets a host up)."""

from __future__ import annotations

import sys

from ._cli._main import main

sys.exit(main())
