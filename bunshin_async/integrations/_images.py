"""Image references as the harnesses write them, turned into Bunshin images (shared by the inspect-ai, Harbor and
mini-swe-agent integrations).

A harness names an image one of three ways: a reference (``python:3.12``, ``my-task:latest``), a Dockerfile to
build, or (Bunshin's own option) an OCI layout or archive. ``resolve_image`` takes a reference: an image already
in Bunshin's layer store (``bunshin image import``) wins, then the local Docker engine's image of that name
(``Image.from_docker``, exported once and cached by its config digest). ``build_dockerfile`` builds with the local
Docker engine's CLI and imports the result. No registry is contacted by Bunshin itself; ``docker build`` may pull
what the Dockerfile's ``FROM`` names if the engine can reach a registry.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path

import anyio

from .._exceptions import CapabilityMissing, ImageError
from .._images._image import BASE_NAME, Image

__all__ = ["build_dockerfile", "import_archive", "resolve_image"]

#: How an image built from a Dockerfile is tagged in the Docker engine (``<prefix>-<name>:<digest of the context>``).
BUILD_TAG_PREFIX = "bunshin-build"


async def resolve_image(ref: str | None) -> Image | None:
    """The image ``ref`` names: None (Bunshin's Debian base) for an empty ref or ``debian-bookworm``; an image in the
    layer store; else the local Docker engine's image ``ref``. Raises ``ImageError`` when none has it."""
    if not ref:
        return None
    if ref == BASE_NAME:
        return await anyio.to_thread.run_sync(Image.base)
    try:
        return await anyio.to_thread.run_sync(Image.load, ref)
    except ImageError as not_imported:
        try:
            return await Image.from_docker(ref)
        except (ImageError, CapabilityMissing) as exc:
            raise ImageError(
                f"image {ref!r} is neither in Bunshin's layer store ({not_imported}) nor in the local Docker engine "
                f"({exc}); import it with `bunshin image import`",
                image=ref,
            ) from exc


async def import_archive(path: str | os.PathLike[str], *, name: str | None = None) -> Image:
    """An OCI image layout (a directory or a tarball of one) or a ``docker save`` archive, imported into the layer
    store (layers already there are not unpacked again)."""
    p = Path(path)
    if await anyio.to_thread.run_sync(p.is_dir):
        return await Image.from_oci(p, name=name)

    def has_oci_layout() -> bool:
        try:
            with tarfile.open(p) as tf:
                return any(m.name.lstrip("./") == "oci-layout" for m in tf.getmembers())
        except (OSError, tarfile.TarError) as exc:
            raise ImageError(f"cannot read image archive {str(p)!r}: {exc}", image=str(p)) from exc

    if await anyio.to_thread.run_sync(has_oci_layout):
        return await Image.from_oci(p, name=name)
    return await Image.from_docker_archive(p, name=name)


def _context_digest(dockerfile: Path, context: Path) -> str:
    h = hashlib.sha256(dockerfile.read_bytes())
    for p in sorted(context.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h.update(str(p.relative_to(context)).encode() + b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


async def build_dockerfile(
    dockerfile: str | os.PathLike[str], *, context: str | os.PathLike[str] | None = None, name: str = "image"
) -> Image:
    """Build ``dockerfile`` (context: its directory unless given) with the local Docker engine, tagged by the
    digest of the Dockerfile and the context (a rebuild of unchanged sources is the engine's cache hit), and import
    the result."""
    df = await anyio.Path(dockerfile).resolve()
    ctx = Path(await anyio.Path(context).resolve()) if context is not None else Path(df.parent)
    if not await df.is_file():
        raise ImageError(f"Dockerfile {str(df)!r} does not exist", image=str(df))
    docker = shutil.which("docker")
    if docker is None:
        raise CapabilityMissing(
            "building a Dockerfile needs the Docker CLI and engine", capability="docker", remedy="run `make setup`"
        )
    digest = await anyio.to_thread.run_sync(_context_digest, Path(df), ctx)
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower()).strip("-.") or "image"
    tag = f"{BUILD_TAG_PREFIX}-{safe}:{digest}"
    proc = await anyio.run_process([docker, "build", "-q", "-t", tag, "-f", str(df), str(ctx)], check=False)
    if proc.returncode != 0:
        raise ImageError(
            f"docker build of {str(df)!r} failed: {proc.stderr.decode(errors='replace')[-2000:]}", image=str(df)
        )
    return await Image.from_docker(tag)
