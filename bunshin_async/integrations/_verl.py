"""verl: a tool agent loop whose tools run in Bunshin workspaces through the tool prefix cache.

``BunshinToolAgentLoop`` is verl's ``ToolAgentLoop`` registered as ``bunshin_tool_agent`` (set
``actor_rollout_ref.rollout.agent.default_agent_loop`` or a dataset's ``agent_name`` to it). verl instantiates one
loop per sample and repeats each prompt ``n`` times under one ``uid``: the loop gives each sample a workspace
from ``GroupForks``, so the samples of one ``uid`` set the task up once and start as forks of it (``GroupRollout``'s
semantics inside verl). The task comes from the sample's ``extra_info["bunshin"]`` (``files``, ``setup``,
``background``, ``ready``, ``reward_command``, ``task_id``); with a ``reward_command`` the loop sets the output's
``reward_score`` (1.0 when it exits 0 in the sample's final workspace).

verl's loop calls each ``BaseTool`` through ``create``/``execute``/``release`` per call, so the per-sample state
(the workspace's ``CachedSession``) rides on the loop's ``AgentData``, which ``execute`` receives. ``BashTool``,
``ReadFileTool`` and ``WriteFileTool`` are those tools, for ``actor_rollout_ref.rollout.multi_turn.tool_config_path``::

    tools:
      - class_name: bunshin_async.integrations.verl.BashTool
        config: {type: native}

The loop closes its workspace on every exit path (an answer, a turn or length limit, an error, cancellation).
"""

from __future__ import annotations

from typing import Any, ClassVar

import anyio

from .._cache._cache import CachedSession, ToolCache
from .._cache._state import ForkStateProvider
from .._exceptions import InvalidArgument, ToolError
from .._rollout._rollout import Task, command_reward
from .._tools._tools import Tool, bash_tool, read_file_tool, write_file_tool
from ..agent import observation
from ._groups import GroupForks
from ._require import require

require("verl", framework="verl", extra="verl")

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput  # noqa: E402
from verl.experimental.agent_loop.agent_loop import register as _register_agent_loop  # noqa: E402
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop  # noqa: E402
from verl.tools.base_tool import BaseTool  # noqa: E402
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse  # noqa: E402

__all__ = [
    "AGENT_NAME",
    "BashTool",
    "BunshinToolAgentLoop",
    "ReadFileTool",
    "VerlRuntime",
    "WriteFileTool",
    "default_runtime",
]

AGENT_NAME = "bunshin_tool_agent"
_SESSION_ATTR = "_bunshin_session"


class VerlRuntime:
    """What the loops of one verl worker process share: the group snapshots (``forks``) and the tool cache
    (``cache``, with write hits served by fork). Use it from the worker's event loop."""

    def __init__(self, *, forks: GroupForks | None = None, cache: ToolCache | None = None) -> None:
        self.forks = forks or GroupForks()
        self.cache = cache or ToolCache(provider=ForkStateProvider())

    async def aclose(self) -> None:
        """Free every workspace, snapshot and cached state still held."""
        await self.forks.aclose()
        await self.cache.aclose()


_default: VerlRuntime | None = None


def default_runtime() -> VerlRuntime:
    """The runtime of this process's loops (made on first use)."""
    global _default
    if _default is None:
        _default = VerlRuntime()
    return _default


def _task(extra_info: Any, uid: str | None) -> Task:
    spec = extra_info.get("bunshin") if isinstance(extra_info, dict) else None
    spec = dict(spec or {})
    files = spec.get("files") or {}
    if not isinstance(files, dict):
        raise InvalidArgument("extra_info['bunshin']['files'] must map paths to contents", tool="verl")
    return Task(
        task_id=str(spec.get("task_id") or uid or "task"),
        prompt="",
        files={str(p): c.encode() if isinstance(c, str) else bytes(c) for p, c in files.items()},
        setup=[str(c) for c in spec.get("setup") or ()],
        background=[str(c) for c in spec.get("background") or ()],
        ready=[str(c) for c in spec.get("ready") or ()],
        reward_command=spec.get("reward_command"),
    )


class _WorkspaceTool(BaseTool):  # type: ignore[misc]
    """A verl ``BaseTool`` running a Bunshin tool in the sample's workspace, through its ``CachedSession``."""

    make_tool: ClassVar[Any]

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        self.bunshin_tool: Tool = type(self).make_tool()
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(self.bunshin_tool.spec())
        super().__init__(config, schema)

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(self.bunshin_tool.spec())

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        session: CachedSession | None = getattr(kwargs.get("agent_data"), _SESSION_ATTR, None)
        if session is None:
            text = f"error: {self.name} runs in a Bunshin workspace; use agent_name {AGENT_NAME!r}"
            return ToolResponse(text=text), 0.0, {}
        metrics: dict[str, Any]
        try:
            record = await session.call_ex(self.bunshin_tool.name, parameters)
            outcome: Any = record.result
            metrics = {"bunshin_source": record.source}
        except ToolError as exc:  # a result the model should read (a missing file, a timeout, bad arguments)
            outcome, metrics = exc, {"bunshin_source": "error"}
        return ToolResponse(text=observation(outcome).output), 0.0, metrics


class BashTool(_WorkspaceTool):
    """``bash``: a shell command in the sample's workspace."""

    make_tool = staticmethod(bash_tool)


class ReadFileTool(_WorkspaceTool):
    """``read_file``: a file of the sample's workspace."""

    make_tool = staticmethod(read_file_tool)


class WriteFileTool(_WorkspaceTool):
    """``write_file``: create or replace a file of the sample's workspace."""

    make_tool = staticmethod(write_file_tool)


@_register_agent_loop(AGENT_NAME)
class BunshinToolAgentLoop(ToolAgentLoop):  # type: ignore[misc]
    """verl's tool agent loop with each sample in a Bunshin workspace (module doc)."""

    runtime: VerlRuntime | None = None
    """The runtime to use; None: ``default_runtime()``."""

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        runtime = self.runtime or default_runtime()
        uid = kwargs.get("uid")
        group = None if uid is None else str(uid)
        task = _task(kwargs.get("extra_info"), group)
        tools = [t.bunshin_tool for t in self.tools.values() if isinstance(t, _WorkspaceTool)]
        ws = await runtime.forks.acquire(task, group)
        session = runtime.cache.session(ws, tools, salt=task.task_id)
        self._session = session
        try:
            output: AgentLoopOutput = await super().run(sampling_params, priority, **kwargs)
            if task.reward_command is not None:
                output.reward_score, _ = await command_reward(session.workspace, task)
            output.extra_fields["bunshin_fork_mode"] = ws.fork_mode
            return output
        finally:
            with anyio.CancelScope(shield=True):
                await session.aclose()  # closes the forks a cached write moved the sample into
                await runtime.forks.release(ws, group)

    async def _handle_pending_state(self, agent_data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        setattr(agent_data, _SESSION_ATTR, self._session)
        return await super()._handle_pending_state(agent_data, sampling_params)
