"""E2B protocol benchmark: what the unmodified ``e2b`` SDK pays through ``E2BServer`` beside the native SDK, in one
run, interleaved sample by sample (the machine may be shared: compare the ratios, not the absolute times).

Rows: ``create_to_first_command`` (a new sandbox / workspace and its first ``true``), ``command_round_trip``
(``commands.run("true")`` / ``ws.exec("true")`` on a live one), ``fork8`` (``fork(count=8)`` of a sandbox with a
running process / ``ws.fork(8)``), ``file_round_trip`` (write then read 4 KiB). Prints one JSON object: milliseconds
(median, p90, min, max) per side and ``ratio`` = protocol median / native median. ``--quick`` takes fewer samples.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
from e2b import AsyncSandbox

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sdk_exit import exit_without_finalizing  # noqa: E402
from _stats import summary  # noqa: E402

from bunshin_async import Workspace  # noqa: E402
from bunshin_async.integrations.e2b import E2BServer  # noqa: E402

Timed = Callable[[], Awaitable[float]]


async def _pair(n: int, native: Timed, protocol: Timed) -> dict[str, Any]:
    """``n`` samples of each side, alternating, after one warm-up of each."""
    await native()
    await protocol()
    a, b = [], []
    for _ in range(n):
        a.append(await native())
        b.append(await protocol())
    res = {"native": summary(a), "e2b_protocol": summary(b)}
    res["ratio"] = round(res["e2b_protocol"]["median"] / max(res["native"]["median"], 1e-6), 2)
    return res


async def run(opts: dict[str, str], n: int, n_fork: int) -> dict[str, Any]:
    out: dict[str, Any] = {}

    async def native_create() -> float:
        t = time.perf_counter()
        async with Workspace() as ws:
            await ws.exec("true")
            return time.perf_counter() - t

    async def e2b_create() -> float:
        t = time.perf_counter()
        sbx = await AsyncSandbox.create(**opts)
        await sbx.commands.run("true")
        took = time.perf_counter() - t
        await sbx.kill()
        return took

    out["create_to_first_command"] = await _pair(n, native_create, e2b_create)

    async with Workspace() as ws:
        sbx = await AsyncSandbox.create(timeout=3600, **opts)
        try:

            async def native_run() -> float:
                t = time.perf_counter()
                await ws.exec("true")
                return time.perf_counter() - t

            async def e2b_run() -> float:
                t = time.perf_counter()
                await sbx.commands.run("true")
                return time.perf_counter() - t

            out["command_round_trip"] = await _pair(n, native_run, e2b_run)

            data = b"x" * 4096

            async def native_file() -> float:
                t = time.perf_counter()
                await ws.exec(["sh", "-c", "cat > /tmp/f"], stdin=data)
                await ws.exec(["cat", "/tmp/f"])
                return time.perf_counter() - t

            async def e2b_file() -> float:
                t = time.perf_counter()
                await sbx.files.write("/tmp/f", data)
                await sbx.files.read("/tmp/f", format="bytes")
                return time.perf_counter() - t

            out["file_round_trip"] = await _pair(n, native_file, e2b_file)

            await ws.spawn("sleep 3600")
            await sbx.commands.run("sleep 3600", background=True, timeout=0)

            async def native_fork() -> float:
                t = time.perf_counter()
                copies = await ws.fork(8)
                took = time.perf_counter() - t
                for c in copies:
                    await c.aclose()
                return took

            async def e2b_fork() -> float:
                t = time.perf_counter()
                copies = await sbx.fork(count=8)
                took = time.perf_counter() - t
                for c in copies:
                    assert isinstance(c, AsyncSandbox), c
                    await c.kill()
                return took

            out["fork8"] = await _pair(n_fork, native_fork, e2b_fork)
        finally:
            await sbx.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, n_fork = (5, 2) if args.quick else (30, 8)
    with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(E2BServer()) as srv:
        opts = {"api_url": srv.url, "sandbox_url": srv.url, "api_key": srv.api_key}
        res = anyio.run(run, opts, n, n_fork)
    res["conditions"] = (
        "one process: E2BServer on its own event loop thread, the SDK (async) and the native SDK on the main one; "
        "loopback HTTP/1.1; samples interleaved; the machine may be shared (compare ratios)"
    )
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
    exit_without_finalizing(0)  # the SDK's HTTP client can abort a finalizing 3.11 (bench/_sdk_exit.py)
