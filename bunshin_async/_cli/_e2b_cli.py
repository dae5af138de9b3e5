"""``bunshin e2b serve``: an E2B-compatible endpoint on workspaces until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import anyio

from .._exceptions import BunshinError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["serve"])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=3000, help="port (default 3000; 0 picks a free one)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("BUNSHIN_E2B_API_KEY"),
        help="the key clients send as E2B_API_KEY (default: $BUNSHIN_E2B_API_KEY, else a random one, printed); "
        "required on a non-loopback address",
    )
    parser.add_argument("--max-sandboxes", type=int, default=256)
    parser.add_argument(
        "--no-gc", action="store_true", help="skip `bunshin gc` of workspaces left by dead processes at start"
    )
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="place sandboxes on the Ray cluster at ADDRESS ('auto', HOST:PORT): a workspace host on each alive "
        "node, stopped with the server (each collects what a dead one left)",
    )
    parser.add_argument("--ray-slots", type=int, default=16, help="workspaces per Ray node at once (default 16)")


def serve_main(args: argparse.Namespace) -> int:
    try:
        from ..integrations.e2b import E2BServer

        server = E2BServer(
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            max_sandboxes=args.max_sandboxes,
            ray=args.ray,
            ray_slots=args.ray_slots,
        )
    except BunshinError as exc:  # the e2b or ray extra is missing, or no key on a public address
        print(f"bunshin e2b: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        if not args.no_gc and not args.ray:  # a Ray host collects its node when it starts
            from .._workspace._gc import collect

            removed = [line for line in await anyio.to_thread.run_sync(collect) if not line.startswith("kept")]
            for line in removed:
                print(f"gc: {line}", file=sys.stderr)
        async with server:
            for key, value in server.env.items():
                print(f"export {key}={value}", flush=True)
            print(f"bunshin e2b: serving on {server.url} (SIGTERM or Ctrl-C stops it)", file=sys.stderr, flush=True)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
        print(f"bunshin e2b: stopped; {server.sandboxes.reaped} sandboxes reaped by timeout", file=sys.stderr)

    try:
        anyio.run(run)
    except BunshinError as exc:  # the Ray cluster cannot be joined, its hosts run already, ...
        print(f"bunshin e2b: {exc}", file=sys.stderr)
        return 1
    return 0
