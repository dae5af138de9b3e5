"""A workspace's final state as two runs that must agree compare it: the experiment's equivalence check
(speculation and the cache on against off) and the differential tests use this one probe, so they compare the
same thing."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._workspace._facade import Workspace

__all__ = ["STATE_COMMAND", "workspace_state"]

STATE_COMMAND = (
    "cd /workspace && find . -xdev -printf '%y %m %p -> %l\\n' | LC_ALL=C sort && "
    "find . -xdev -type f ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum"
)
"""Every entry under /workspace (type, mode, path, link target) and the hash of every regular file. Compiled
bytecode is listed but not hashed: a .pyc embeds its source's mtime, which differs between runs by design."""


async def workspace_state(ws: Workspace, *, timeout: float = 60) -> str:
    """``STATE_COMMAND``'s exit status and output in ``ws``, then the workspace's processes (their command lines,
    sorted; not zombies, not the agent's, not the probe's own ``ps``). Equal states give equal text."""
    files = await ws.exec(STATE_COMMAND, timeout=timeout)
    ps = await ws.exec(["ps", "-eo", "stat=,args="], timeout=timeout)
    procs = sorted(
        " ".join(words[1:])
        for words in map(str.split, ps.stdout.splitlines())
        if words and not words[0].startswith("Z") and words[1:2] != ["ps"] and "bunshin" not in " ".join(words)
    )
    return f"{files.exit_code}\n{files.stdout}--\n" + "\n".join(procs)
