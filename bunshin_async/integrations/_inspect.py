"""An inspect-ai sandbox provider, ``bunshin``: each sample's sandbox is a Bunshin workspace.

inspect finds providers through its ``inspect_ai`` entry-point group; Bunshin's pyproject names this module there,
so ``sandbox="bunshin"`` works once the package is installed. The task's sandbox config picks the image::

    Task(dataset=..., solver=..., scorer=..., sandbox="bunshin")                       # Bunshin's Debian base
    Task(..., sandbox=("bunshin", "my-task:latest"))                                  # a Bunshin or Docker image
    Task(..., sandbox=("bunshin", "Dockerfile"))                                      # built by the Docker engine
    Task(..., sandbox=SandboxEnvironmentSpec("bunshin", BunshinSandboxConfig(oci="image.tar", memory=2 << 30)))

One workspace per sample (``sample_init``), closed on every exit path (``sample_cleanup``, and ``task_cleanup``
for any a cancelled sample left). Files: paths inside the workspace's working directory go through the agent's
file tools; others are staged there and moved by the workspace's own ``cat`` (the host never resolves a path in
the workspace). Every file operation acts as root, as Docker's provider does in an image whose user is root.

Epochs are not forked from one set-up: inspect's ``sample_init`` is not told the epoch, and a sample's files and
setup script are applied by inspect after it returns, so there is no set-up to share at that point.
"""

from __future__ import annotations

import posixpath
import secrets
import shlex
from pathlib import Path
from typing import Any, Literal, overload

import anyio

from .._exceptions import BunshinError, FileNotFound, InvalidArgument, PathOutsideWorkspace, ToolTimeout
from .._host._kernel import Limits
from .._images._image import Image
from .._workspace._facade import Workspace
from ._images import build_dockerfile, import_archive, resolve_image
from ._require import require

require("inspect_ai", framework="inspect-ai", extra="inspect")

from inspect_ai.util import (  # noqa: E402
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from inspect_ai.util._sandbox.environment import SandboxUnavailableError  # noqa: E402
from pydantic import BaseModel  # noqa: E402

__all__ = ["BunshinSandboxConfig", "BunshinSandboxEnvironment"]

_STAGE = ".bunshin-inspect-"  # staged files in the working directory, for paths outside it


class BunshinSandboxConfig(BaseModel, frozen=True):
    """The ``bunshin`` provider's config. One of ``image`` (a Bunshin image reference, else the local Docker
    engine's), ``dockerfile`` (built with the local Docker engine; ``context`` defaults to its directory) or ``oci``
    (an OCI layout directory or archive, or a ``docker save`` archive); none means Bunshin's Debian base.
    ``workdir``: the per-sample directory (default: the image's WorkingDir, else /workspace). ``env``: variables for
    every command. ``memory`` (bytes), ``pids``, ``cpus``: the workspace's limits."""

    image: str | None = None
    dockerfile: str | None = None
    context: str | None = None
    oci: str | None = None
    workdir: str | None = None
    env: dict[str, str] = {}
    memory: int | None = None
    pids: int | None = None
    cpus: float | None = None

    def __hash__(self) -> int:  # inspect hashes sandbox specs; ``env`` (a dict) has no hash of its own
        return hash(self.model_dump_json())


def _config(config: SandboxEnvironmentConfigType | None) -> BunshinSandboxConfig:
    """The config inspect hands over: None, ours, or a string (a Dockerfile's path, an archive's, or a reference)."""
    if config is None:
        return BunshinSandboxConfig()
    if isinstance(config, BunshinSandboxConfig):
        return config
    if isinstance(config, str):
        p = Path(config)
        if p.is_file() and "dockerfile" in p.name.lower():
            return BunshinSandboxConfig(dockerfile=str(p.resolve()))
        if p.exists():
            return BunshinSandboxConfig(oci=str(p.resolve()))
        return BunshinSandboxConfig(image=config)
    raise InvalidArgument(
        f"the bunshin sandbox takes a BunshinSandboxConfig or a string, not {config!r}", tool="inspect"
    )


async def _image(cfg: BunshinSandboxConfig) -> Image | None:
    if cfg.dockerfile:
        return await build_dockerfile(cfg.dockerfile, context=cfg.context)
    if cfg.oci:
        return await import_archive(cfg.oci)
    return await resolve_image(cfg.image)


@sandboxenv(name="bunshin")
class BunshinSandboxEnvironment(SandboxEnvironment):  # type: ignore[misc]  # untyped here: inspect lives elsewhere
    """One sample's sandbox: one Bunshin workspace (``workspace``). See the module doc."""

    _images: dict[str, Image | None] = {}  # by the config's JSON
    _live: dict[str, Workspace] = {}

    def __init__(self, workspace: Workspace) -> None:
        super().__init__()
        self.workspace = workspace

    # ------------------------------------------------------------------------------------------ lifecycle

    @classmethod
    async def _resolve(cls, cfg: BunshinSandboxConfig) -> Image | None:
        key = cfg.model_dump_json()
        if key not in cls._images:
            cls._images[key] = await _image(cfg)
        return cls._images[key]

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        """Build or import the task's image once, before its samples start."""
        await cls._resolve(_config(config))

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        cfg = _config(config)
        defaults = Limits()
        ws = Workspace(
            await cls._resolve(cfg),
            workdir=cfg.workdir,
            env=cfg.env,
            limits=Limits(
                memory=cfg.memory or defaults.memory, pids=cfg.pids or defaults.pids, cpus=cfg.cpus or defaults.cpus
            ),
            # one byte over inspect's limit shows that the limit was passed
            max_output=SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE + 1,
        )
        await ws.start()  # removes what it made on failure or cancellation
        cls._live[ws.id] = ws
        return {"default": cls(ws)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        with anyio.CancelScope(shield=True):
            for env in environments.values():
                if isinstance(env, BunshinSandboxEnvironment):
                    cls._live.pop(env.workspace.id, None)
                    await env.workspace.aclose()

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        """Close any workspace a cancelled or failed sample left open."""
        with anyio.CancelScope(shield=True):
            while cls._live:
                _, ws = cls._live.popitem()
                await ws.aclose()

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return BunshinSandboxConfig(**config)

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        """A host command (as root) that opens a shell in the workspace's namespaces, in its working directory."""
        ws = self.workspace
        if ws.closed or ws.pid is None:
            raise ConnectionError(f"workspace {ws.id} is not running")
        shell = ["su", "-", user] if user else ["/bin/sh", "-c", "exec bash -l 2>/dev/null || exec sh -l"]
        argv = ["nsenter", f"--target={ws.pid}", "--all", f"--wdns={ws.workdir}", "--", *shell]
        return SandboxConnection(type="bunshin", command=shlex.join(argv), container=ws.id)

    # ------------------------------------------------------------------------------------------ commands

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workspace.workdir, path))

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        ws = self.workspace
        if ws.closed:
            raise SandboxUnavailableError(f"workspace {ws.id} is closed")
        try:
            r = await ws.exec(
                list(cmd),
                cwd=self._path(cwd) if cwd is not None else None,
                env=env,
                stdin=input,
                timeout=timeout,
                user=user,
            )
        except ToolTimeout as exc:
            raise TimeoutError(f"command timed out after {timeout} s: {shlex.join(cmd)}") from exc
        except FileNotFound as exc:  # a missing command or working directory: the command's failure
            return ExecResult(success=False, returncode=127, stdout="", stderr=str(exc))
        except InvalidArgument as exc:
            message = str(exc)
            if "permission denied" in message.lower():
                raise PermissionError(message) from exc
            return ExecResult(success=False, returncode=126, stdout="", stderr=message)  # e.g. no such user
        except BunshinError as exc:
            raise SandboxUnavailableError(f"workspace {ws.id}: {exc}") from exc
        if r.truncated:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, r.stdout)
        return ExecResult(success=r.exit_code == 0, returncode=r.exit_code, stdout=r.stdout, stderr=r.stderr)

    # ------------------------------------------------------------------------------------------ files

    def _inside(self, target: str) -> bool:
        workdir = self.workspace.workdir
        return target == workdir or target.startswith(workdir.rstrip("/") + "/")

    async def _run_as_root(self, script: str, *args: str) -> tuple[int, str]:
        r = await self.workspace.exec(["/bin/sh", "-c", script, "sh", *args], user="root", timeout=600)
        return r.exit_code, r.stderr

    async def write_file(self, file: str, contents: str | bytes) -> None:
        target = self._path(file)
        data = contents.encode() if isinstance(contents, str) else contents
        if self._inside(target):
            try:
                await self.workspace.write_file(target, data)
            except BunshinError as exc:
                raise _file_error(exc, file) from exc
            return
        stage = self._path(_STAGE + secrets.token_hex(8))
        try:
            await self.workspace.write_file(stage, data)
            code, err = await self._run_as_root(
                '[ -d "$2" ] && exit 21; mkdir -p -- "$(dirname -- "$2")" && cat -- "$1" > "$2"', stage, target
            )
        finally:
            with anyio.CancelScope(shield=True):
                await self._remove_stage(stage)
        if code == 21:
            raise IsADirectoryError(f"{file}: is a directory")
        if code != 0:
            raise PermissionError(f"cannot write {file}: {err.strip()}") if "denied" in err else OSError(err.strip())

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        target = self._path(file)
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        if self._inside(target):
            data = await self._read(target, file, limit)
        else:
            stage = self._path(_STAGE + secrets.token_hex(8))
            try:
                code, err = await self._run_as_root(
                    '[ -d "$1" ] && exit 21; [ -e "$1" ] || exit 22; cat -- "$1" > "$2"', target, stage
                )
                if code == 21:
                    raise IsADirectoryError(f"{file}: is a directory")
                if code == 22:
                    raise FileNotFoundError(f"{file}: no such file or directory")
                if code != 0:
                    raise PermissionError(f"cannot read {file}: {err.strip()}")
                data = await self._read(stage, file, limit)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._remove_stage(stage)
        # newline="" semantics: bytes decode as they are, CRLF kept
        return data.decode("utf-8") if text else data

    async def _read(self, path: str, file: str, limit: int) -> bytes:
        try:
            data = await self.workspace.read_file(path, max_bytes=limit + 1)
        except BunshinError as exc:
            raise _file_error(exc, file) from exc
        if len(data) > limit:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        return data

    async def _remove_stage(self, stage: str) -> None:
        if not self.workspace.closed:
            try:
                await self.workspace.remove(stage)
            except FileNotFound:
                pass


def _file_error(exc: BunshinError, file: str) -> Exception:
    """inspect's file errors (the standard library's) for the agent's."""
    message = f"{file}: {exc}"
    if isinstance(exc, FileNotFound):
        return FileNotFoundError(message)
    lowered = str(exc).lower()
    if "is a directory" in lowered:
        return IsADirectoryError(message)
    if "permission denied" in lowered or isinstance(exc, PathOutsideWorkspace):
        return PermissionError(message)
    return OSError(message)
