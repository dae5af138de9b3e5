"""A mini-swe-agent environment whose commands run in a Bunshin workspace.

mini-swe-agent picks an environment by class path (``environment_class``) and calls it synchronously:
``execute(action, cwd="", *, timeout=None) -> {"output", "returncode", "exception_info"}``, raising ``Submitted``
when a command's output starts with its completion marker. ``BunshinEnvironment`` starts one workspace when it is
made (as mini's Docker environment starts a container) on a ``PortalRuntime`` (a loop in a background thread) and
runs each action there through bash, stderr merged into stdout as mini's other environments do::

    env = BunshinEnvironment(image="my-task:latest", cwd="/testbed", timeout=60)
    agent = DefaultAgent(model, env, **agent_config)
    agent.run("fix the failing test")
    env.cleanup()

or ``environment_class: bunshin_async.integrations.mini_swe_agent.BunshinEnvironment`` in a mini config. ``image``
is a Bunshin image, else a local Docker engine image (``_images.resolve_image``); empty means Bunshin's Debian base.
``cleanup()`` (also on garbage collection and at interpreter exit) frees the workspace.
"""

from __future__ import annotations

import atexit
import platform
from typing import Any

from .._exceptions import BunshinError, ToolTimeout, UsageError
from .._host._kernel import Limits
from .._workspace._facade import Workspace
from ._images import resolve_image
from ._portal import PortalRuntime
from ._require import require

require("minisweagent", framework="mini-swe-agent", extra="mini-swe-agent")

from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.utils.serialize import recursive_merge  # noqa: E402
from pydantic import BaseModel  # noqa: E402

__all__ = ["BunshinEnvironment", "BunshinEnvironmentConfig", "default_runtime"]

#: The first output line by which a command says the task is done (mini-swe-agent's own environments use it).
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

_default = PortalRuntime()


def default_runtime() -> PortalRuntime:
    """The runtime environments use unless given one."""
    return _default


atexit.register(_default.close_all)


class BunshinEnvironmentConfig(BaseModel):
    """``image``: a Bunshin or local Docker image reference (empty: Bunshin's Debian base). ``cwd``: where commands
    run (empty: the workspace's working directory). ``env``: variables for every command. ``timeout``: seconds per
    command. ``memory`` (bytes), ``pids``, ``cpus``: the workspace's limits (None: Bunshin's defaults)."""

    image: str = ""
    cwd: str = ""
    env: dict[str, str] = {}
    timeout: int = 30
    memory: int | None = None
    pids: int | None = None
    cpus: float | None = None


class BunshinEnvironment:
    """mini-swe-agent's ``Environment`` on one Bunshin workspace (module doc). Keyword arguments are
    ``BunshinEnvironmentConfig``'s; ``runtime`` is the loop that owns the workspace (``default_runtime()``)."""

    def __init__(
        self,
        *,
        config_class: type[BunshinEnvironmentConfig] = BunshinEnvironmentConfig,
        runtime: PortalRuntime | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config_class(**kwargs)
        self.runtime = runtime or _default
        self.workspace: Workspace | None = None
        self.workspace = self.runtime.start(self.runtime.call(self._make))

    async def _make(self) -> Workspace:
        image = await resolve_image(self.config.image)
        defaults = Limits()
        limits = Limits(
            memory=self.config.memory or defaults.memory,
            pids=self.config.pids or defaults.pids,
            cpus=self.config.cpus or defaults.cpus,
        )
        return Workspace(image, limits=limits, env=self.config.env)

    def _ws(self) -> Workspace:
        if self.workspace is None or self.workspace.closed:
            raise UsageError("the Bunshin workspace of this environment is closed", what="BunshinEnvironment")
        return self.workspace

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` through bash in the workspace; raise ``Submitted`` on the completion marker."""
        command = action.get("command", "")
        ws = self._ws()
        seconds = timeout or self.config.timeout
        workdir = cwd or self.config.cwd or None
        try:
            # The shell's own stderr joins stdout for the whole script, so the model sees one interleaved stream.
            r = self.runtime.call(lambda: ws.exec("exec 2>&1\n" + command, cwd=workdir, timeout=seconds))
            output: dict[str, Any] = {"output": r.stdout, "returncode": r.exit_code, "exception_info": ""}
        except ToolTimeout as exc:
            output = _failed(exc, exc.stdout + exc.stderr)
        except BunshinError as exc:
            output = _failed(exc, "")
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        ws = self.workspace
        extra = {"workspace_id": ws.id if ws is not None else "", "cwd": self.config.cwd or (ws.workdir if ws else "")}
        merged: dict[str, Any] = recursive_merge(self.config.model_dump(), _uname(), extra, kwargs)
        return merged

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }

    def cleanup(self) -> None:
        """Close the workspace. Idempotent."""
        ws, self.workspace = getattr(self, "workspace", None), None
        if ws is not None:
            self.runtime.close(ws)

    def __enter__(self) -> BunshinEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:  # noqa: BLE001 - the interpreter may be shutting down; close_all runs at exit anyway
            pass


def _uname() -> dict[str, str]:
    u = platform.uname()
    return {"system": u.system, "node": u.node, "release": u.release, "version": u.version, "machine": u.machine}


def _failed(exc: BunshinError, output: str) -> dict[str, Any]:
    return {
        "output": output,
        "returncode": -1,
        "exception_info": f"An error occurred while executing the command: {exc}",
        "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
    }
