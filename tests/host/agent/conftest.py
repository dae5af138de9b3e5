"""Agent tests run real workspaces. ``busybox_image`` is a root filesystem holding nothing but Debian's static
busybox (no Python, no bash, no shared library), built per session under a temporary directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin_async import Image

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static (scripts/setup.sh installs it)

PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\nalice:x:1500:1500:Alice:/home/alice:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
)
GROUP = "root:x:0:\nalice:x:1500:\ndevs:x:1600:bob,alice\nops:x:1700:alice\nnogroup:x:65534:\n"


def make_busybox_root(root: Path, *, shell: bool = True) -> Path:
    """A root with /bin/busybox and, for each applet but ``sh`` when ``shell`` is False, a symlink to it."""
    assert BUSYBOX.exists(), "busybox-static is missing: run `make setup`"
    out = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in out.split():
        if applet in ("busybox", "bash") or (not shell and applet in ("sh", "ash", "hush")):
            continue
        os.symlink("busybox", root / "bin" / applet)
    for d in ("etc", "tmp", "workspace", "root", "home/alice"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    os.chown(root / "home/alice", 1500, 1500)
    (root / "etc/passwd").write_text(PASSWD)
    (root / "etc/group").write_text(GROUP)
    return root


@pytest.fixture(scope="session")
def busybox_image() -> Iterator[Image]:
    tmp = Path(tempfile.mkdtemp(prefix="bunshin-busybox-"))
    try:
        yield Image.from_dir(make_busybox_root(tmp / "rootfs"), name="busybox")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def no_shell_image() -> Iterator[Image]:
    tmp = Path(tempfile.mkdtemp(prefix="bunshin-noshell-"))
    try:
        yield Image.from_dir(make_busybox_root(tmp / "rootfs", shell=False), name="busybox-noshell")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
