"""Test images, built on the real Docker engine in the test set-up and cached in it by content (the tag is a digest
of the Dockerfile directory and of its base), so a rerun finds them and builds nothing.

No registry is reachable: the bookworm base is ``docker import`` of Bunshin's own debootstrapped base image, the
trixie base (Debian 13, python3.13) is debootstrapped from the host's mirror once, and everything else is
``docker build --network=none`` over them with the Dockerfiles in ``dockerfiles/``.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from bunshin_async._images._image import Image, apt_mirror

DOCKER = "/usr/bin/docker"  # Debian's client for the engine scripts/docker.sh starts
HERE = Path(__file__).parent
TRIXIE_PACKAGES = ("python3",)


def docker(*args: str, stdin: object = None) -> str:
    r = subprocess.run([DOCKER, *args], capture_output=True, stdin=stdin)  # type: ignore[call-overload]
    if r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed: {r.stderr.decode()[-2000:]}")
    return str(r.stdout.decode())


def have(tag: str) -> bool:
    return subprocess.run([DOCKER, "image", "inspect", tag], capture_output=True).returncode == 0


def _import_root(root: Path, tag: str) -> None:
    """``docker import`` of a root directory, without its /dev (the workspace's /dev is the agent layer's)."""
    tar = subprocess.Popen(["tar", "-C", str(root), "--exclude=./dev", "-c", "."], stdout=subprocess.PIPE)
    try:
        docker("import", "-", tag, stdin=tar.stdout)
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0:
            raise RuntimeError(f"tar of {root} failed")


def bookworm() -> str:
    base = Image.base()
    tag = f"bunshin-test/bookworm:{base.digest[:12]}"
    if not have(tag):
        _import_root(Path(base.rootfs), tag)
    return tag


def trixie() -> str:
    """Debian 13 (python3.13), debootstrapped from the mirror the host's apt uses."""
    recipe = hashlib.sha256(f"trixie:minbase:{','.join(TRIXIE_PACKAGES)}:v1".encode()).hexdigest()
    tag = f"bunshin-test/trixie:{recipe[:12]}"
    if have(tag):
        return tag
    tmp = Path(tempfile.mkdtemp(prefix="bunshin-trixie-", dir="/var/tmp"))
    try:
        root = tmp / "rootfs"
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(TRIXIE_PACKAGES)}", "trixie", str(root),
             apt_mirror()],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        for rel in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for child in (root / rel).glob("*"):
                if child.is_file():
                    child.unlink()
        _import_root(root, tag)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tag


def build(name: str, base: str) -> str:
    """``docker build`` of ``dockerfiles/<name>`` FROM ``base`` (its ``ARG BASE``), cached by content."""
    context = HERE / "dockerfiles" / name
    h = hashlib.sha256(base.encode())
    for p in sorted(context.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(context)).encode())
            h.update(p.read_bytes())
    tag = f"bunshin-test/{name}:{h.hexdigest()[:12]}"
    if not have(tag):
        docker("build", "--network=none", "-q", "--build-arg", f"BASE={base}", "-t", tag, str(context))
    return tag
