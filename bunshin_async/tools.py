"""The tool model: ``Tool`` (schema, handler, effect class), the built-in tools that act on a ``Workspace`` and the
shell-command classifier; a call's effect class (``pure``, ``read``, ``write``, ``external``) decides whether the
cache may serve it and the speculator run it ahead (see ``bunshin_async._tools._tools``)::

    classify_command("grep -rn TODO src")      # CallClass(effect=Effect.READ, deterministic=True)
    tools = [*builtin_tools(), bash_tool(timeout=60).with_effect(Effect.EXTERNAL)]
"""

from __future__ import annotations

from ._public import publish as _publish
from ._tools._gui_tools import gui_tools
from ._tools._tools import (
    CallClass,
    Effect,
    Handler,
    Tool,
    bash_tool,
    builtin_tools,
    classify_command,
    list_dir_tool,
    python_tool,
    read_file_tool,
    validate_schema,
    write_file_tool,
)

__all__ = [
    "CallClass",
    "Effect",
    "Handler",
    "Tool",
    "bash_tool",
    "builtin_tools",
    "classify_command",
    "gui_tools",
    "list_dir_tool",
    "python_tool",
    "read_file_tool",
    "validate_schema",
    "write_file_tool",
]

_publish(__name__, globals())
