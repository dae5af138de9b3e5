"""The reliability campaign (issue #20, item 4): slow, run in CI; its counts are sized to keep the whole directory
under ~6 minutes on the 2-core CI machine (``BUNSHIN_SOAK_CYCLES`` and friends raise them)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]
