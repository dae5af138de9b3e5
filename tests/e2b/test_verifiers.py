"""A second E2B client not written against Bunshin: verifiers' ``E2BRuntime`` (unmodified, in ``.venv-verifiers``:
its pins do not fit the main venv; scripts/harness-env.sh builds it) drives the server from a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import Served

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"


def test_verifiers_e2b_runtime_runs_commands_and_files(e2b_server: Served, tmp_path: Path) -> None:
    from tests.images._build import bookworm

    assert PYTHON.exists(), f"{PYTHON} is missing: run `make setup` (scripts/harness-env.sh)"
    image = bookworm()  # a Docker image of the local engine: the template is built from it
    # verifiers keeps its template locks under $HOME/.cache; the SDK finds the server through E2B_*.
    # A crash of the client (in a library it loads) prints its threads' stacks and libc's message to stderr.
    env = {
        **os.environ,
        **e2b_server.server.env,
        "HOME": str(tmp_path),
        "PYTHONFAULTHANDLER": "1",
        "LIBC_FATAL_STDERR_": "1",
    }
    client = [str(PYTHON), str(Path(__file__).with_name("verifiers_client.py")), image]
    proc = subprocess.run(client, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads(proc.stdout.splitlines()[-1])

    assert out["template"].startswith("vf-")  # a template build (Template().from_image) the server served
    assert out["run"] == [3, "hi 1\n/app\nroot\n", "err\n"]  # exit code, both streams, its cwd and user
    assert out["file_equal"] is True
    assert out["file_sum"] == hashlib.sha256(bytes(range(256)) * 64).hexdigest()  # the bytes, seen inside
    assert out["program"] == [5, "durable\n", "warn\n"]
    assert out["process"] == [0, "line \xff\n"]  # stdin in, exact bytes out, exit code
    # teardown killed its sandbox; the template stays, as E2B keeps it
    portal, sandboxes = e2b_server.portal, e2b_server.server.sandboxes
    assert portal.call(lambda: sandboxes.matching({}, None)) == []
    assert sandboxes.template(f"{out['template']}:default") is not None
