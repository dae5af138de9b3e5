"""The reliability campaign (issue #20, item 4): slow, run in CI; its counts are sized to keep the whole directory
under ~10 minutes on an idle 2-core CI machine, ~4 of them the 2,000 fork cycles (``BUNSHIN_SOAK_CYCLES`` and
friends change them)."""

from __future__ import annotations
