"""Adapters for the frameworks agent and RL developers already use; one public module per framework.

- ``bunshin_async.integrations.mcp``: an MCP server exposing workspaces' tools, and MCP servers' tools as Bunshin
  ``Tool``s (extra ``bunshin[mcp]``);
- ``bunshin_async.integrations.openai_agents``: a sandbox client for the OpenAI Agents SDK (``bunshin[openai-agents]``);
- ``bunshin_async.integrations.skyrl``: a SkyRL-gym environment (``bunshin[skyrl]``);
- ``bunshin_async.integrations.mini_swe_agent``: an environment class for mini-swe-agent (``bunshin[mini-swe-agent]``,
  in an environment of its own: ``scripts/harness-env.sh``);
- ``bunshin_async.integrations.inspect``: the ``bunshin`` sandbox provider for inspect-ai (``bunshin[inspect]``, the
  same environment);
- ``bunshin_async.integrations.harbor``: ``BunshinEnvironment`` for Harbor (``bunshin[harbor]``, Python >= 3.12, in
  ``.venv-harbor``).

Importing this package imports no framework; importing a module whose framework is missing raises
``CapabilityMissing`` naming the extra to install.
"""

from __future__ import annotations

__all__: list[str] = []
