"""Fork tests run real workspaces and real CRIU (the README's test command builds it). The root conftest checks
that no snapshot or child process (a restored pid 1 is our own child) is left after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bunshin_async import Workspace

HERE = Path(__file__).parent

pytestmark = pytest.mark.root


@pytest.fixture
async def ws() -> AsyncIterator[Workspace]:
    async with Workspace() as w:
        await w.write_file("/workspace/guest_state.py", (HERE / "guest_state.py").read_bytes())
        yield w
