"""The OpenAI Agents SDK (``pip install 'bunshin[openai-agents]'``): a sandbox client whose sessions are Bunshin
workspaces, with ``fork(session, n)``. See ``bunshin_async.integrations._openai_agents``::

    async with BunshinSandboxClient() as client:
        config = RunConfig(sandbox=SandboxRunConfig(client=client, options=BunshinSandboxClientOptions()))
        result = await Runner.run(SandboxAgent(name="coder", instructions="..."), "task", run_config=config)
"""

from __future__ import annotations

from .._public import publish as _publish
from ._openai_agents import (
    BunshinSandboxClient,
    BunshinSandboxClientOptions,
    BunshinSandboxSession,
    BunshinSandboxSessionState,
)

__all__ = ["BunshinSandboxClient", "BunshinSandboxClientOptions", "BunshinSandboxSession", "BunshinSandboxSessionState"]

_publish(__name__, globals())
