"""Template builds (``Template().from_image(...)``, ``AsyncTemplate.build``) as snapshots of a built workspace.

A build starts a workspace of its base (``fromImage``: an imported image or one of the local Docker engine, as for
``create``; ``fromTemplate``: a template or snapshot of this server), runs its steps in it (``RUN`` through a login
shell, ``ENV``, ``WORKDIR``, ``USER``), starts ``startCmd`` and waits for ``readyCmd``, then keeps a snapshot of it
under the template's names: ``create(name)`` restores it, processes included. ``COPY`` steps are refused (their
files would go to an upload URL this server does not serve): write files in a ``RUN`` step or bake them into the
image. Logs keep the last ``MAX_LOG_LINES`` lines.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import msgspec

from .._exceptions import BunshinError
from ._backends import Handle

MAX_LOG_LINES = 2000
STEP_TIMEOUT = 3600.0
READY_TIMEOUT = 300.0


class TemplateRequest(msgspec.Struct, rename="camel"):
    name: str = ""
    tags: list[str] | None = None


class Step(msgspec.Struct, rename="camel"):
    type: str
    args: list[str] = []
    files_hash: str | None = None


class BuildStart(msgspec.Struct, rename="camel"):
    from_image: str | None = None
    from_template: str | None = None
    steps: list[Step] = []
    start_cmd: str | None = None
    ready_cmd: str | None = None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class Build:
    """One build of a template: its status (``waiting``, ``building``, ``ready``, ``error``) and log."""

    name: str
    aliases: list[str]
    template_id: str = field(default_factory=lambda: f"tpl{secrets.token_hex(8)}")
    build_id: str = field(default_factory=lambda: f"bld{secrets.token_hex(8)}")
    status: str = "waiting"
    log: list[dict[str, str]] = field(default_factory=list)
    dropped: int = 0
    reason: str | None = None

    def say(self, message: str, level: str = "info") -> None:
        self.log.append({"timestamp": _now(), "level": level, "message": message[:4000]})
        if len(self.log) > MAX_LOG_LINES:
            del self.log[0]
            self.dropped += 1

    def status_body(self, offset: int) -> dict[str, Any]:
        entries = self.log[max(0, offset - self.dropped) :][:100]  # the SDK pages by 100
        body: dict[str, Any] = {
            "templateID": self.template_id,
            "buildID": self.build_id,
            "status": self.status,
            "logs": [e["message"] for e in entries],
            "logEntries": entries,
        }
        if self.reason is not None:
            body["reason"] = {"message": self.reason}
        return body


class Builder(Protocol):
    """What a build needs of the sandbox registry (``_sandboxes.Sandboxes``)."""

    async def fresh(
        self, template_id: str, metadata: Mapping[str, str], env: Mapping[str, str] | None = None
    ) -> Handle: ...

    async def restore(self, template_id: str) -> Handle: ...

    def template(self, alias: str) -> str | None: ...

    async def keep_template(self, ws: Handle, build: Build, workdir: str) -> None: ...


class StepFailed(BunshinError):
    """A build step failed (``step``: its index)."""

    step: int

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message, step=step)


async def run_build(sandboxes: Builder, build: Build, start: BuildStart) -> None:
    """Build in a workspace, keep its snapshot under the template's names; the outcome is in ``build``."""
    build.status = "building"
    ws: Handle | None = None
    try:
        base = start.from_template
        if base is not None and sandboxes.template(base) is not None:
            build.say(f"FROM template {base}")
            ws = await sandboxes.restore(base)
        else:  # an image (E2B's "base" template: Bunshin's base image)
            build.say(f"FROM {start.from_image or 'base'}")
            ws = await sandboxes.fresh(start.from_image or base or "base", {})
        workdir, user = "/home/user", None
        for i, step in enumerate(start.steps):
            build.say(f"{step.type} {' '.join(step.args)}"[:500])
            if step.type == "RUN" and step.args:
                res = await ws.exec(
                    ["/bin/bash", "-l", "-c", step.args[0]],
                    cwd=workdir,
                    user=step.args[1] if len(step.args) > 1 else user,
                    timeout=STEP_TIMEOUT,
                )
                for line in (res.stdout + res.stderr).splitlines()[-200:]:
                    build.say(line)
                if res.exit_code != 0:
                    raise StepFailed(f"step {i + 1} ({step.args[0][:200]}) exited with {res.exit_code}", step=i)
            elif step.type == "ENV":
                await ws.configure(env=dict(zip(step.args[0::2], step.args[1::2], strict=False)))
            elif step.type == "WORKDIR" and step.args:
                workdir = step.args[0]
                await ws.exec(["mkdir", "-p", "--", workdir])
            elif step.type == "USER" and step.args:
                user = step.args[0]
                await ws.configure(user=user)
            else:
                raise StepFailed(
                    f"{step.type} steps are not served by bunshin e2b (write files in a RUN step, or bake them into "
                    "the image you import with `bunshin image import`)",
                    step=i,
                )
        if start.start_cmd:
            build.say(f"start: {start.start_cmd}")
            await ws.spawn(["/bin/bash", "-l", "-c", start.start_cmd], cwd=workdir)
        if start.ready_cmd:
            build.say(f"ready: {start.ready_cmd}")
            with anyio.fail_after(READY_TIMEOUT):
                ready = ["/bin/bash", "-l", "-c", start.ready_cmd]
                while (await ws.exec(ready, cwd=workdir)).exit_code != 0:  # noqa: ASYNC110 - a command to poll
                    await anyio.sleep(0.5)
        await sandboxes.keep_template(ws, build, workdir)
        build.say("build ready")
        build.status = "ready"
    except (BunshinError, TimeoutError, OSError) as exc:
        build.reason = f"{type(exc).__name__}: {exc}"
        build.say(build.reason, "error")
        build.status = "error"
    finally:
        if ws is not None:
            with anyio.CancelScope(shield=True):
                await ws.aclose()
