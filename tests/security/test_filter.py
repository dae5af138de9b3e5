"""The seccomp program of native/security.c, run in a BPF interpreter for every syscall number (filter_check.c):
each verdict is the one its allow-list, its capability-gated lists and its argument rules give, for the default
capability set and for every capability kept. The kernel side is exercised by test_escapes.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bunshin_async import Security

HERE = Path(__file__).parent


def test_filter_matches_its_lists(tmp_path: Path) -> None:
    exe = tmp_path / "filter_check"
    subprocess.run(["cc", "-O1", "-w", "-o", str(exe), str(HERE / "filter_check.c")], check=True)
    default = f"{Security().capability_mask():x}"
    every = f"{Security.off().capability_mask():x}"
    r = subprocess.run([str(exe), default, every], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.endswith("ok\n"), r.stdout + r.stderr
