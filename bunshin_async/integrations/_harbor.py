"""A Harbor environment on a Bunshin workspace, plugged in by import path::

    harbor run -p tasks/my-task --env bunshin_async.integrations.harbor:BunshinEnvironment -a oracle

The task's ``docker_image`` names the image (a Bunshin image, else the local Docker engine's:
``_images.resolve_image``); without one, ``environment/Dockerfile`` is built with the local Docker engine. The
environment option ``oci`` (``--ek oci=PATH``) imports an OCI layout or archive instead. ``start`` creates
``/logs/{verifier,agent,artifacts}``. Files move through the workspace's file tools: a host file is read on the host
and written by the agent into a staging file in the working directory, then moved by the workspace's own ``cat``
or ``tar``; downloads go the other way. Nothing on the host resolves a path inside the workspace.

Capabilities, truthfully: a workspace has a loopback-only network, so ``disable_internet`` is declared and a task
asking for public network or an allow-list is rejected before start. No GPUs, no mounts, no Compose.
"""

from __future__ import annotations

import io
import secrets
import shlex
import tarfile
from pathlib import Path
from typing import Any

import anyio

from .._exceptions import BunshinError, InvalidValue, ToolError, ToolTimeout, UsageError, WorkspaceStartError
from .._host._kernel import Limits
from .._images._image import Image
from .._workspace._facade import Workspace
from ._images import build_dockerfile, import_archive, resolve_image
from ._require import require

require("harbor", framework="Harbor", extra="harbor")

from harbor.environments.base import BaseEnvironment, ExecResult  # noqa: E402
from harbor.environments.capabilities import EnvironmentCapabilities  # noqa: E402
from harbor.models.task.config import NetworkMode  # noqa: E402

__all__ = ["BunshinEnvironment"]

#: The largest file or directory archive ``download_*`` takes from a workspace (the workspace decides its size).
MAX_DOWNLOAD_BYTES = 1 << 30
_STAGE = ".bunshin-harbor-"
_LOG_DIRS = ("/logs/verifier", "/logs/agent", "/logs/artifacts")


class BunshinEnvironment(BaseEnvironment):  # type: ignore[misc]  # untyped here: Harbor lives in .venv-harbor
    """Harbor's ``BaseEnvironment`` on one Bunshin workspace (module doc). Extra keyword arguments (``--ek``):
    ``oci`` (an image archive to import), ``image`` (overrides the task's ``docker_image``)."""

    def __init__(self, *args: Any, oci: str | None = None, image: str | None = None, **kwargs: Any) -> None:
        self._oci = oci
        self._image_ref = image
        self.workspace: Workspace | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "bunshin"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def validate_network_policy_support(self, network_policy: Any = None) -> None:
        super().validate_network_policy_support(network_policy)
        policy = network_policy or self._network_policy
        if policy.network_mode != NetworkMode.NO_NETWORK:
            raise InvalidValue(  # also the ValueError Harbor's own check raises for a policy it cannot honour
                "the bunshin environment has no network but loopback: set network_mode = 'no-network' in the task",
                argument="network_mode",
            )

    def _validate_definition(self) -> None:
        if self._oci or self._image_ref or self.task_env_config.docker_image:
            return
        if not (self.environment_dir / "Dockerfile").is_file():
            # Harbor's protocol: its own environments' _validate_definition raises FileNotFoundError
            raise FileNotFoundError(f"{self.environment_dir / 'Dockerfile'} not found and the task names no image")

    # ------------------------------------------------------------------------------------------ lifecycle

    async def _image(self) -> Image | None:
        if self._oci:
            return await import_archive(self._oci)
        ref = self._image_ref or self.task_env_config.docker_image
        if ref:
            return await resolve_image(ref)
        return await build_dockerfile(self.environment_dir / "Dockerfile", name=self.environment_name)

    def _ws(self) -> Workspace:
        if self.workspace is None or self.workspace.closed:
            raise UsageError("the bunshin environment is not started", what="BunshinEnvironment")
        return self.workspace

    async def start(self, force_build: bool) -> None:
        defaults = Limits()
        memory_mb = self._effective_memory_mb
        cpus = self._effective_cpus
        ws = Workspace(
            await self._image(),
            workdir=self.task_env_config.workdir or None,
            env=self._startup_env(),
            limits=Limits(
                memory=memory_mb * (1 << 20) if memory_mb else defaults.memory,
                pids=defaults.pids,
                cpus=float(cpus) if cpus else defaults.cpus,
            ),
        )
        await ws.start()
        self.workspace = ws
        try:
            r = await ws.exec(["mkdir", "-p", *_LOG_DIRS], user="root", timeout=60)
            if r.exit_code != 0:
                raise WorkspaceStartError(f"cannot create {', '.join(_LOG_DIRS)}: {r.stderr}", workspace_id=ws.id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop(delete=True)
            raise

    async def stop(self, delete: bool) -> None:
        ws, self.workspace = self.workspace, None
        if ws is not None:
            with anyio.CancelScope(shield=True):
                await ws.aclose()

    # ------------------------------------------------------------------------------------------ commands

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        ws = self._ws()
        who = self._resolve_user(user)
        try:
            r = await ws.exec(
                command,
                cwd=cwd,
                env=self._merge_env(env),
                timeout=float(timeout_sec) if timeout_sec else None,
                user=None if who is None else str(who),
            )
        except ToolTimeout as exc:
            # Harbor's protocol: an exec past timeout_sec raises the built-in TimeoutError (its trial maps it)
            raise TimeoutError(f"command timed out after {timeout_sec} s") from exc
        except BunshinError as exc:
            return ExecResult(stdout="", stderr=str(exc), return_code=127)
        return ExecResult(stdout=r.stdout, stderr=r.stderr, return_code=r.exit_code)

    # ------------------------------------------------------------------------------------------ files

    async def _staged(self, data: bytes) -> str:
        ws = self._ws()
        stage = f"{ws.workdir}/{_STAGE}{secrets.token_hex(8)}"
        await ws.write_file(stage, data)
        return stage

    async def _in_workspace(self, script: str, *args: str) -> None:
        r = await self._ws().exec(["/bin/sh", "-c", script, "sh", *args], user="root", timeout=600)
        if r.exit_code != 0:
            tool = script.split()[0]
            raise ToolError(f"{tool} in the workspace failed: {r.stderr.strip()[-2000:]}", tool=tool)

    async def _unstage(self, stage: str) -> None:
        with anyio.CancelScope(shield=True):
            if self.workspace is not None and not self.workspace.closed:
                await self.workspace.exec(["rm", "-f", "--", stage], user="root", timeout=60)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = await anyio.Path(source_path).read_bytes()
        stage = await self._staged(data)
        try:
            await self._in_workspace('mkdir -p -- "$(dirname -- "$2")" && cat -- "$1" > "$2"', stage, target_path)
        finally:
            await self._unstage(stage)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        def pack() -> bytes:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tf:
                tf.add(str(source_dir), arcname=".")
            return buf.getvalue()

        stage = await self._staged(await anyio.to_thread.run_sync(pack))
        try:
            await self._in_workspace('mkdir -p -- "$2" && tar -C "$2" --no-same-owner -xf "$1"', stage, target_dir)
        finally:
            await self._unstage(stage)

    async def _fetch(self, script: str, source: str) -> bytes:
        ws = self._ws()
        stage = f"{ws.workdir}/{_STAGE}{secrets.token_hex(8)}"
        try:
            await self._in_workspace(script, source, stage)
            return await ws.read_file(stage, max_bytes=MAX_DOWNLOAD_BYTES)
        finally:
            await self._unstage(stage)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._fetch('[ -f "$1" ] && cat -- "$1" > "$2"', source_path)
        target = anyio.Path(target_path)
        await target.parent.mkdir(parents=True, exist_ok=True)
        await target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        data = await self._fetch('tar -C "$1" -cf "$2" .', source_dir)

        def unpack() -> None:
            dest = Path(target_dir)
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                # the archive comes from the workspace: "data" refuses links out, absolute names and devices
                tf.extractall(dest, filter="data")

        await anyio.to_thread.run_sync(unpack)

    def __repr__(self) -> str:
        ws = self.workspace
        return (
            f"<BunshinEnvironment {self.session_id} {ws.id if ws else 'stopped'} {shlex.quote(self.environment_name)}>"
        )
