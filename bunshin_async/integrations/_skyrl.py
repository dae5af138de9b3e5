"""A SkyRL-gym environment whose episodes run in Bunshin workspaces.

SkyRL-gym's interface is synchronous (``init``/``step``/``close``); the SDK is async. ``EnvRuntime`` runs one
event loop in a background thread (an anyio blocking portal) that owns every workspace of its environments, and
each call of an environment blocks on it. ``BunshinTextEnv`` is registered as ``bunshin-bash``::

    env = skyrl_gym.make("bunshin-bash", env_config={"timeout": 60}, extras={
        "setup": ["pip install -e ."], "files": {"t.py": "..."}, "reward_command": "pytest -q",
        "group_id": "prompt-17", "max_turns": 20,
    })
    obs, info = env.init([{"role": "user", "content": "fix the bug"}])
    out = env.step("<bash>pytest -q</bash>")   # observation, reward, done, metadata
    env.close()

The model acts with ``<bash>command</bash>``; an action without one (or ``max_turns``) ends the episode, and the
reward is 1.0 when the ``reward_command`` exits 0 in the episode's workspace. Environments whose extras carry the
same ``group_id`` (the n samples of one prompt) set the task up once: the first builds and snapshots a base
workspace, every member starts as a fork of it (``GroupRollout``'s semantics inside SkyRL). The group's snapshot
is freed when its last open member closes. ``close()`` frees the episode's workspace; ``EnvRuntime.close_all()``
(also run at interpreter exit) frees those of environments a trainer abandoned, timed out or cancelled. The
group logic is ``GroupForks`` (``_groups``), shared with the verl integration.
"""

from __future__ import annotations

import atexit
import re
from collections.abc import Mapping
from typing import Any

from .._exceptions import BunshinError, InvalidArgument
from .._host._kernel import Limits
from .._images._image import Image
from .._rollout._rollout import Task, command_reward
from .._workspace._facade import Workspace
from ..agent import observation as tool_observation
from ._groups import GroupForks
from ._portal import PortalRuntime
from ._require import require

require("skyrl_gym", framework="SkyRL-gym", extra="skyrl")

import skyrl_gym  # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType  # noqa: E402

__all__ = ["ENV_ID", "BunshinTextEnv", "EnvRuntime", "default_runtime", "register"]

ENV_ID = "bunshin-bash"
_ACTION = re.compile(r"<bash>(.*?)</bash>", re.DOTALL)


class EnvRuntime(PortalRuntime):
    """The event loop (``PortalRuntime``: a blocking portal in a daemon thread) and the group snapshots
    (``GroupForks``) behind ``BunshinTextEnv``s. Thread-safe: environments of many threads may share one.
    ``close_all()`` closes every workspace and snapshot it holds and stops the loop; a later call starts a new one."""

    def __init__(self, *, image: Image | None = None) -> None:
        super().__init__()
        self.forks = GroupForks(image=image)

    def group_setups(self, group_id: str) -> int:
        """How many times the group's task was set up (1 while its members overlap)."""
        return self.forks.setups(group_id)

    @property
    def live_workspaces(self) -> int:
        return self.forks.live

    async def _aclose_owned(self) -> None:
        await self.forks.aclose()


_default = EnvRuntime()
atexit.register(_default.close_all)


def default_runtime() -> EnvRuntime:
    """The runtime environments use unless given one (closed at interpreter exit)."""
    return _default


def _get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


class BunshinTextEnv(BaseTextEnv):  # type: ignore[misc]
    """One episode in one workspace (module doc). ``env_config`` (a mapping or an OmegaConf ``DictConfig``):
    ``timeout`` per command in seconds (default 120), ``max_output`` characters of output shown per step (default
    10,000), ``memory``/``pids``/``cpus`` limits. ``extras``: ``files`` (path -> text), ``setup``, ``background``,
    ``ready`` (commands, as a ``Task``'s), ``reward_command``, ``group_id``, ``task_id``, ``max_turns``
    (default 10)."""

    def __init__(
        self,
        env_config: Any = None,
        extras: Mapping[str, Any] | None = None,
        *,
        runtime: EnvRuntime | None = None,
    ) -> None:
        super().__init__()
        extras = dict(extras or {})
        self.runtime = runtime or _default
        self.timeout = float(_get(env_config, "timeout", 120.0))
        self.max_output = int(_get(env_config, "max_output", 10_000))
        defaults = Limits()
        self.limits = Limits(
            memory=_get(env_config, "memory", None) or defaults.memory,
            pids=_get(env_config, "pids", None) or defaults.pids,
            cpus=_get(env_config, "cpus", None) or defaults.cpus,
        )
        self.max_turns = int(extras.get("max_turns", 10))
        group = extras.get("group_id")
        self.group_id: str | None = None if group is None else str(group)
        files = extras.get("files") or {}
        if not isinstance(files, Mapping):
            raise InvalidArgument("extras['files'] must map paths to contents", tool="skyrl")
        self.task = Task(
            task_id=str(extras.get("task_id", self.group_id or "task")),
            prompt="",
            files={str(p): c.encode() if isinstance(c, str) else bytes(c) for p, c in files.items()},
            setup=[str(c) for c in extras.get("setup") or ()],
            background=[str(c) for c in extras.get("background") or ()],
            ready=[str(c) for c in extras.get("ready") or ()],
            reward_command=extras.get("reward_command"),
        )
        self.workspace: Workspace | None = None
        self.chat_history: ConversationType = []

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Start the episode's workspace (a fork of the group's set-up when ``group_id`` is given)."""
        if self.workspace is not None:
            raise InvalidArgument("init() was already called on this environment", tool="skyrl")
        self.workspace = self.runtime.portal.call(self._start)
        self.chat_history = list(prompt)
        return prompt, {"workspace_id": self.workspace.id, "fork_mode": self.workspace.fork_mode}

    async def _start(self) -> Workspace:
        return await self.runtime.forks.acquire(self.task, self.group_id, limits=self.limits)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.workspace is None:
            raise InvalidArgument("call init() before step()", tool="skyrl")
        self.turns += 1
        self.chat_history.append({"role": "assistant", "content": action})
        match = _ACTION.search(action)
        if match is None or self.turns >= self.max_turns:
            observation = self._run(match.group(1)) if match is not None else None
            reward, output = self.runtime.portal.call(command_reward, self.workspace, self.task)
            obs = [] if observation is None else [{"role": "user", "content": observation}]
            return BaseTextEnvStepOutput(
                observations=obs,
                reward=reward,
                done=True,
                metadata={"reward_output": output, "turns": self.turns},
                postprocessed_action=action,
            )
        observation = self._run(match.group(1))
        self.chat_history.append({"role": "user", "content": observation})
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": observation}],
            reward=0.0,
            done=False,
            metadata={"turns": self.turns},
            postprocessed_action=action,
        )

    def _run(self, command: str) -> str:
        assert self.workspace is not None
        ws, timeout = self.workspace, self.timeout
        try:
            outcome: Any = self.runtime.portal.call(lambda: ws.exec(command, timeout=timeout))
        except BunshinError as exc:
            outcome = exc
        return tool_observation(outcome, max_chars=self.max_output).output  # what run_agent's model sees

    def close(self) -> None:
        """Close the episode's workspace (and leave its group). Idempotent."""
        ws, self.workspace = self.workspace, None
        if ws is not None:
            self.runtime.portal.call(self.runtime.forks.release, ws, self.group_id)

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns}


def register(env_id: str = ENV_ID) -> None:
    """Register ``BunshinTextEnv`` with ``skyrl_gym`` as ``env_id`` (done for ``bunshin-bash`` on import)."""
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{BunshinTextEnv.__module__}:BunshinTextEnv")


register()
