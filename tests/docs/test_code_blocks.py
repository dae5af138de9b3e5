"""The documentation's code runs: every ``python`` block of the README's quickstart, the getting-started page, the
GRPO guide, the images guide and the MCP guide is extracted and executed as a script of its own, on real
workspaces (root, CRIU), as a reader would paste it. A block that stops working fails here, not for the reader."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.conftest import ROOT

PAGES = ["README.md", "docs/getting-started.md", "docs/guides/grpo.md", "docs/guides/images.md",
         "docs/integrations/mcp.md", "docs/install.md"]  # fmt: skip
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def blocks(page: str, lang: str = "python") -> list[str]:
    return [body for kind, body in FENCE.findall((ROOT / page).read_text()) if kind == lang]


def cases() -> list[object]:
    return [pytest.param(page, i, id=f"{page}#{i}") for page in PAGES for i in range(len(blocks(page)))]


@pytest.mark.unit
def test_every_listed_page_has_code() -> None:
    assert all(blocks(page) for page in PAGES)
    assert len(blocks("README.md")) == 2  # the quickstart and the GRPO group


@pytest.fixture(scope="session")
def task_image() -> str:
    """``my-task:latest`` on the local Docker engine, built from the images guide's own Dockerfile over the test
    suite's Debian base (no registry is reachable: its ``FROM`` is replaced)."""
    from tests.images._build import bookworm

    [dockerfile] = blocks("docs/guides/images.md", "dockerfile")
    dockerfile = re.sub(r"^FROM .*$", f"FROM {bookworm()}", dockerfile, count=1, flags=re.M)
    r = subprocess.run(["docker", "build", "--network=none", "-q", "-t", "my-task:latest", "-"],
                       input=dockerfile.encode(), capture_output=True)  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return "my-task:latest"


@pytest.mark.slow
@pytest.mark.parametrize(("page", "index"), cases())
def test_code_block_runs(page: str, index: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if "images" in page:
        request.getfixturevalue("task_image")
    code = blocks(page)[index]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, f"{page} block {index}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    if "fork(" in code and ".fork_mode" in code:  # the copies are live copies, not filesystem-only ones
        assert "criu-cow" in r.stdout, r.stdout
