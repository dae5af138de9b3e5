"""``python -m bench.experiment`` (``make run``), from the checkout's root."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
