"""``bunshin e2b serve`` as a user runs it: the environment it prints reaches it, SIGTERM closes its sandboxes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import anyio
import pytest
from e2b import AsyncSandbox

pytestmark = pytest.mark.root

CLI = [sys.executable, "-m", "bunshin_async", "e2b", "serve"]


def test_a_public_address_without_a_key_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k != "BUNSHIN_E2B_API_KEY"}
    res = subprocess.run([*CLI, "--host", "0.0.0.0", "--no-gc"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2 and "without an API key" in res.stderr


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = str(other.getsockname()[1])
        res = subprocess.run([*CLI, "--port", port, "--no-gc"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "the port is taken" in res.stderr and "Traceback" not in res.stderr, res.stderr


async def test_serve_prints_its_environment_and_closes_sandboxes_on_sigterm() -> None:
    with subprocess.Popen([*CLI, "--port", "0", "--no-gc"], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            lines = [await anyio.to_thread.run_sync(proc.stdout.readline) for _ in range(3)]
            env = dict(line.removeprefix("export ").strip().split("=", 1) for line in lines)
            assert set(env) == {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"}
            opts = {"api_url": env["E2B_API_URL"], "sandbox_url": env["E2B_SANDBOX_URL"], "api_key": env["E2B_API_KEY"]}
            sbx = await AsyncSandbox.create(timeout=600, **opts)
            assert (await sbx.commands.run("echo up")).stdout == "up\n"
            await sbx.commands.run("sleep 600", background=True, timeout=0)
        finally:
            proc.send_signal(signal.SIGTERM)
            code = await anyio.to_thread.run_sync(proc.wait, 60)
    assert code == 0  # and the autouse leak check finds none of its workspaces
