"""Run by test_killed_run.py as a test run of its own (``pytest tests/reliability/killed_run_child.py``), which it
SIGKILLs: a workspace with its disk (a tmpfs in the run dir) and a snapshot on the run's store, then it says so
(the file ``$KILLED_RUN_READY``) and waits to be killed. Not collected by a plain run (no ``test_`` file name)."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from bunshin_async import Workspace

pytestmark = pytest.mark.root


async def test_hold_a_workspace_until_killed() -> None:
    ready = Path(os.environ["KILLED_RUN_READY"])
    async with Workspace() as ws:
        await ws.exec("echo data > /tmp/f")
        async with await ws.snapshot():
            ready.with_suffix(".part").write_text(str(os.getpid()))
            ready.with_suffix(".part").rename(ready)
            with anyio.move_on_after(300):  # a hang guard: test_killed_run SIGKILLs it here
                await anyio.sleep_forever()
