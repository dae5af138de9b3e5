"""``bunshin mcp serve``: a ``WorkspaceServer`` over stdio or streamable HTTP until the client leaves or a signal."""

from __future__ import annotations

import argparse
import sys
from contextlib import AsyncExitStack

import anyio

from .._cache._cache import ToolCache
from .._cache._state import ForkStateProvider
from .._exceptions import BunshinError


def serve_main(args: argparse.Namespace) -> int:
    try:
        from ..integrations._mcp import WorkspaceServer, serve
    except BunshinError as exc:  # the mcp extra is missing: CapabilityMissing says how to install it
        print(f"bunshin mcp: {exc}", file=sys.stderr)
        return 1

    async def run() -> None:
        async with AsyncExitStack() as stack:
            # Writes quicker than a restore (~0.1-0.3 s) are re-run rather than captured.
            cache = (
                await stack.enter_async_context(ToolCache(provider=ForkStateProvider(), capture_min_duration=0.5))
                if args.cache
                else None
            )
            server = WorkspaceServer(display=args.display or None, max_workspaces=args.max_workspaces, cache=cache)
            if args.transport == "http":
                await serve(server, "http", host=args.host, port=args.port, path=args.path)
            else:
                await serve(server, "stdio")

    anyio.run(run)
    return 0
