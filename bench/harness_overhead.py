"""Per-call overhead of the agent-harness integrations over a direct ``ws.exec`` of the same command on the same
workspace, the two alternating call by call (so drift on a shared machine hits both alike). Runs in the harness's
environment: ``.venv-harness`` (mini-swe-agent, inspect-ai; the default) or, with ``--harbor``, ``.venv-harbor``
(Python >= 3.12); ``bench/integrations_bench.py`` runs it there and embeds its JSON.

- mini-swe-agent: ``BunshinEnvironment.execute({"command": "true"})`` from a synchronous caller (through the
  background loop) against ``ws.exec("true")`` awaited on that loop;
- inspect-ai: ``BunshinSandboxEnvironment.exec(["true"])`` against ``ws.exec(["true"])``, both on inspect's loop;
- Harbor: ``BunshinEnvironment.exec("true")`` (a shell command, as Harbor's agents send) against
  ``ws.exec(["/bin/sh", "-c", "true"])`` on the environment's workspace, on the same loop.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import summary  # noqa: E402

HARBOR = "--harbor" in sys.argv
if not HARBOR:  # each environment holds only its own harnesses
    from bunshin_async.integrations._portal import PortalRuntime
    from bunshin_async.integrations.inspect import BunshinSandboxEnvironment
    from bunshin_async.integrations.mini_swe_agent import BunshinEnvironment


def _ratio(direct: list[float], harness: list[float]) -> dict[str, Any]:
    d, h = summary(direct), summary(harness)
    return {"direct_ws_exec": d, "harness": h, "overhead_ms": round(h["median"] - d["median"], 3),
            "ratio": round(h["median"] / d["median"], 3)}  # fmt: skip


def mini(n: int) -> dict[str, Any]:
    rt = PortalRuntime()
    try:
        env = BunshinEnvironment(runtime=rt)
        ws = env.workspace
        assert ws is not None

        async def one_direct() -> float:
            t = time.perf_counter()
            await ws.exec("true")
            return time.perf_counter() - t

        direct, harness = [], []
        env.execute({"command": "true"})
        for _ in range(n):
            direct.append(rt.call(one_direct))
            t = time.perf_counter()
            env.execute({"command": "true"})
            harness.append(time.perf_counter() - t)
        env.cleanup()
        return _ratio(direct, harness)
    finally:
        rt.close_all()


async def inspect_exec(n: int) -> dict[str, Any]:
    envs = await BunshinSandboxEnvironment.sample_init("bench", None, {})
    try:
        env = envs["default"]
        assert isinstance(env, BunshinSandboxEnvironment)
        direct, harness = [], []
        await env.exec(["true"])
        for _ in range(n):
            t = time.perf_counter()
            await env.workspace.exec(["true"])
            direct.append(time.perf_counter() - t)
            t = time.perf_counter()
            await env.exec(["true"])
            harness.append(time.perf_counter() - t)
        return _ratio(direct, harness)
    finally:
        await BunshinSandboxEnvironment.sample_cleanup("bench", None, envs, False)


async def harbor_exec(n: int) -> dict[str, Any]:
    from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
    from harbor.models.trial.paths import TrialPaths

    from bunshin_async.integrations.harbor import BunshinEnvironment as HarborEnvironment

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "environment").mkdir()
        paths = TrialPaths(trial_dir=Path(tmp) / "trial")
        paths.mkdir()
        env = HarborEnvironment(
            environment_dir=Path(tmp) / "environment",
            environment_name="bench",
            session_id="bench__env",
            trial_paths=paths,
            task_env_config=EnvironmentConfig(docker_image="debian-bookworm"),
            network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
        )
        await env.start(force_build=False)
        try:
            ws = env.workspace
            assert ws is not None
            direct, harness = [], []
            await env.exec("true")
            for _ in range(n):
                t = time.perf_counter()
                await ws.exec(["/bin/sh", "-c", "true"])
                direct.append(time.perf_counter() - t)
                t = time.perf_counter()
                r = await env.exec("true")
                harness.append(time.perf_counter() - t)
                assert r.return_code == 0, r
            return _ratio(direct, harness)
        finally:
            await env.stop(delete=True)


def main() -> None:
    n = 30 if "--quick" in sys.argv else 200
    if HARBOR:
        print(json.dumps({"harbor_exec": anyio.run(harbor_exec, n)}, indent=2))
        return
    print(json.dumps({"mini_swe_agent_execute": mini(n), "inspect_exec": anyio.run(inspect_exec, n)}, indent=2))


if __name__ == "__main__":
    main()
