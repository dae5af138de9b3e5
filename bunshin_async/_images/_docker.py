"""The local Docker engine, behind one small interface: look an image up, export it as a ``docker save`` archive.

``AiodockerEngine`` talks to dockerd's API through aiodocker (the optional ``docker`` extra); it needs the asyncio
backend (aiohttp). ``DOCKER_HOST`` (a ``unix://`` or ``tcp://`` URL) picks the daemon, as for the docker CLI.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Protocol

import anyio

from .._exceptions import CapabilityMissing, ImageError

__all__ = ["AiodockerEngine", "DockerEngine", "check_reference", "is_reference"]

# The image reference grammar of distribution/reference (regexp.go): [host[:port]/]path[:tag][@digest], the path's
# components lower-case alphanumerics joined by one of . _ __ or runs of -.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_REFERENCE = re.compile(
    rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"  # name
    r"(?::[\w][\w.-]{0,127})?"  # tag
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"  # digest
)


def is_reference(ref: str) -> bool:
    """Whether ``ref`` is an image reference (``name[:tag][@digest]``, at most 512 characters): anything else must
    not reach the engine's API, whose URLs carry it unescaped (``images/{ref}/json``)."""
    return len(ref) <= 512 and _REFERENCE.fullmatch(ref) is not None


def check_reference(ref: str) -> None:
    if not is_reference(ref):
        raise ImageError(
            f"{ref[:100]!r} is not an image reference ([HOST[:PORT]/]NAME[:TAG][@DIGEST], lower-case name)", image=ref
        )


class DockerEngine(Protocol):
    async def image_id(self, ref: str) -> str:
        """The config digest (``sha256:...``) of ``ref`` in the engine; ImageError when it has no such image."""
        ...

    async def save(self, ref: str, dest: Path) -> None:
        """Write ``docker save`` output for ``ref`` to ``dest``."""
        ...


class AiodockerEngine:
    def __init__(self, url: str | None = None) -> None:
        self.url = url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"

    def _client(self) -> Any:
        try:
            import aiodocker
        except ImportError as exc:
            raise CapabilityMissing(
                "Image.from_docker needs aiodocker",
                capability="aiodocker",
                remedy="pip install 'bunshin[docker]' (make setup installs it)",
            ) from exc
        return aiodocker.Docker(url=self.url)

    def _translate(self, exc: Exception, ref: str) -> Exception:
        import aiodocker

        if isinstance(exc, aiodocker.DockerError):
            if exc.status == 404:
                return ImageError(f"the Docker engine has no image {ref!r}", image=ref)
            return ImageError(f"the Docker engine failed on {ref!r}: {exc.message}", image=ref)
        return CapabilityMissing(
            f"cannot reach the Docker engine at {self.url}: {exc}",
            capability="docker",
            remedy="start dockerd (scripts/docker.sh, run by make setup) or set DOCKER_HOST",
        )

    async def image_id(self, ref: str) -> str:
        check_reference(ref)
        docker = self._client()
        try:
            info = await docker.images.inspect(ref)
        except Exception as exc:  # aiodocker.DockerError, aiohttp's connection errors
            raise self._translate(exc, ref) from exc
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled import must still close its connections
                await docker.close()
        image_id = info.get("Id")
        if not isinstance(image_id, str):
            raise ImageError(f"the Docker engine gave no image ID for {ref!r}", image=ref)
        return image_id

    async def save(self, ref: str, dest: Path) -> None:
        check_reference(ref)
        docker = self._client()
        try:
            # Not ``images.export_image``: its context manager never closes the response, so a cancelled export
            # leaves an acquired connection behind (aiodocker 0.27). ``_query`` is what it wraps.
            async with docker._query(f"images/{ref}/get", "GET", timeout=None) as response:
                try:
                    async with await anyio.open_file(dest, "wb") as out:
                        while chunk := await response.content.read(1 << 20):
                            await out.write(chunk)
                finally:
                    response.close()
        except Exception as exc:
            raise self._translate(exc, ref) from exc
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled import must still close its connections
                await docker.close()
