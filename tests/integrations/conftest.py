"""Fixtures of the integration tests: the environment a server subprocess needs to use this run's directories."""

from __future__ import annotations

import os
import socket


def bunshin_env() -> dict[str, str]:
    """``BUNSHIN_*`` of this test run (its rundir, snapshot dir, cgroup parent) and ``PATH``: a server started as
    a subprocess makes its workspaces where the leak check looks."""
    env = {k: v for k, v in os.environ.items() if k.startswith("BUNSHIN_")}
    env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
