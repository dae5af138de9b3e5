"""Integrations benchmark: what a tool call costs through MCP (in process, stdio, streamable HTTP) against a direct
``ws.exec``, what group forking saves a SkyRL-gym group (the same episodes with and without a ``group_id``), and
the per-call overhead of the mini-swe-agent, inspect-ai and Harbor integrations over ``ws.exec``
(bench/harness_overhead.py).

Prints one JSON object; times are milliseconds (median, p90) unless named ``_s``. ``--quick`` runs fewer samples.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import mcp
from mcp import StdioServerParameters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import summary  # noqa: E402

from bunshin_async import Workspace  # noqa: E402
from bunshin_async.integrations.mcp import WorkspaceServer  # noqa: E402
from bunshin_async.integrations.skyrl import BunshinTextEnv, EnvRuntime  # noqa: E402

BUNSHIN = str(Path(sys.executable).with_name("bunshin"))


async def _calls(client: mcp.Client, n: int) -> list[float]:
    await client.call_tool("bash", {"workspace": "b", "command": "true"})  # starts the workspace
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = await client.call_tool("bash", {"workspace": "b", "command": "true"})
        out.append(time.perf_counter() - t)
        assert not r.is_error
    return out


async def mcp_round_trips(n: int) -> dict[str, Any]:
    async with Workspace() as ws:
        await ws.exec("true")
        direct = []
        for _ in range(n):
            t = time.perf_counter()
            await ws.exec("true")
            direct.append(time.perf_counter() - t)
    async with WorkspaceServer() as srv, mcp.Client(srv.server) as client:
        in_process = await _calls(client, n)
    params = StdioServerParameters(command=BUNSHIN, args=["mcp", "serve"], env={"PATH": os.environ["PATH"]})
    async with mcp.Client(params) as client:
        stdio = await _calls(client, n)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([BUNSHIN, "mcp", "serve", "--transport", "http", "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        with anyio.fail_after(60):
            while True:
                try:
                    async with mcp.Client(url) as client:
                        http = await _calls(client, n)
                    break
                except Exception:
                    await anyio.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(30)
    base = summary(direct)["median"]
    res = {"direct_exec": summary(direct), "in_process": summary(in_process), "stdio": summary(stdio)}
    res["streamable_http"] = summary(http)
    res["overhead_ms_vs_direct"] = {
        k: round(res[k]["median"] - base, 3) for k in ("in_process", "stdio", "streamable_http")
    }
    return res


def skyrl_group(n: int) -> dict[str, Any]:
    extras = {
        "files": {"calc.py": "def add(a, b):\n    return a - b\n"},
        "setup": ["python3 -m venv .venv", ".venv/bin/python -c 'import json, sqlite3, asyncio'"],
        "reward_command": ".venv/bin/python -c 'import calc; assert calc.add(2, 3) == 5'",
    }
    out: dict[str, Any] = {"episodes": n, "setup": extras["setup"]}
    for mode in ("fresh", "group_fork"):
        runtime = EnvRuntime()
        group = {"group_id": f"bench-{mode}"} if mode == "group_fork" else {}

        def episode(i: int, group: dict[str, str] = group, runtime: EnvRuntime = runtime) -> tuple[float, float]:
            env = BunshinTextEnv({}, {**extras, **group}, runtime=runtime)
            t = time.perf_counter()
            env.init([{"role": "user", "content": "fix add"}])
            started = time.perf_counter() - t
            env.step("<bash>sed -i 's/a - b/a + b/' calc.py</bash>")
            reward = float(env.step("done")["reward"])
            env.close()
            return started, reward

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            results = list(pool.map(episode, range(n)))
        wall = time.perf_counter() - t0
        out[mode] = {
            "wall_s": round(wall, 3),
            "init": summary([r[0] for r in results]),
            "rewards": [r[1] for r in results],
            "setups": runtime.group_setups(f"bench-{mode}") if group else n,
        }
        runtime.close_all()
    out["wall_ratio_fork_vs_fresh"] = round(out["group_fork"]["wall_s"] / out["fresh"]["wall_s"], 3)
    return out


def harnesses(quick: bool) -> dict[str, Any]:
    """Each agent harness's per-call overhead over ``ws.exec`` (bench/harness_overhead.py, run in the harness's
    environment: mini-swe-agent and inspect-ai in ``.venv-harness``, Harbor in ``.venv-harbor``, which exists only
    where the set-up's Python is 3.12 or later)."""
    root = Path(__file__).resolve().parents[1]
    out: dict[str, Any] = {}
    for venv, flags, what in (
        (".venv-harness", (), "mini-swe-agent, inspect-ai"),
        (".venv-harbor", ("--harbor",), "Harbor"),
    ):
        python = root / venv / "bin" / "python"
        if not python.exists():
            out[venv.lstrip(".")] = {
                "skipped": f"{what}: {venv} is missing (make setup builds it; Harbor's only on Python >= 3.12)"
            }
            continue
        argv = [str(python), str(root / "bench" / "harness_overhead.py"), *flags, *(["--quick"] if quick else [])]
        env = {**os.environ, "PYTHONPATH": str(root)}
        r = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
        out.update(json.loads(r.stdout))
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    result = {
        "mcp_round_trip_of_true": anyio.run(mcp_round_trips, 20 if quick else 100),
        "skyrl_group": skyrl_group(4 if quick else 8),
        "harness_overhead_over_ws_exec": harnesses(quick),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
