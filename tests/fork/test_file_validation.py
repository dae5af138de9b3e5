"""A dump reads no build-id of the workspace's mapped ELF files (criu/patches/0035, ``CRIU_FILE_VALIDATION=filesize``,
issue 39): that read (an open, an mmap and a walk of the file's notes per file) was 0.35-0.45 ms of the guest's dump
with the tree frozen, and a restore read each again to compare. A copy's files are always the snapshot's own, so
the images keep each file's size, which the restore checks; the copy runs."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from bunshin_async import Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow", "criu"), pytest.mark.tracked]

FILE_VALIDATION_ENV = "file-validation-env"  # the feature criu/patches/0035 adds to `criu --version`


def regular_files(images: Any) -> list[dict[str, Any]]:
    import pycriu.images  # on sys.path once bunshin_async._host._criu is imported

    with open(images / "files.img", "rb") as f:
        return [e["reg"] for e in pycriu.images.load(f)["entries"] if "reg" in e]


async def test_a_dump_keeps_sizes_and_no_build_ids(ws: Workspace) -> None:
    assert FILE_VALIDATION_ENV in criu_features(), "CRIU lacks criu/patches/0035: run criu/build.sh"
    await ws.spawn(["python3", "-c", "import time; open('/workspace/up', 'w').close(); time.sleep(1000)"])
    while (await ws.exec("test -e /workspace/up")).exit_code:  # noqa: ASYNC110 - polls the guest
        await anyio.sleep(0.02)
    async with await ws.snapshot() as snap:
        files = regular_files(record_of(snap).images)
        elf = [r for r in files if "python3" in r["name"] or "libc.so" in r["name"]]
        assert elf, [r["name"] for r in files]  # the interpreter and libc are mapped, ELF files with a build-id
        assert all("size" in r for r in elf)  # what the restore checks
        assert [r["name"] for r in files if r.get("build_id")] == []
        [copy] = await Workspace.from_snapshot(snap)
        try:
            assert (await copy.exec("pgrep -c python3")).stdout.strip() == "1"
        finally:
            await copy.aclose()
