"""E2B (``pip install 'bunshin[e2b]'``): serve Bunshin workspaces to code written for E2B's SDK, unmodified::

    async with E2BServer() as srv:      # http://127.0.0.1:<free port>, a random API key
        os.environ.update(srv.env)      # E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY
        sbx = await e2b.AsyncSandbox.create()
        await sbx.commands.run("echo hi")
        copies = await sbx.fork(count=4)   # live copies: files, processes and memory

``bunshin e2b serve`` runs one from the command line. What is served and what is not: docs/integrations/e2b.md.
"""

from __future__ import annotations

from .._public import publish as _publish
from ._require import require as _require

_require("starlette", framework="the E2B server", extra="e2b")
_require("uvicorn", framework="the E2B server", extra="e2b")

from .._e2b._server import E2BServer  # noqa: E402

__all__ = ["E2BServer"]

_publish(__name__, globals())
