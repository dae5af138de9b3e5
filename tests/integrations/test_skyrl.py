"""The SkyRL-gym environment through ``skyrl_gym.make`` and full episodes, called synchronously as SkyRL does
(from worker threads, the way a trainer's generator would)."""

from __future__ import annotations

import concurrent.futures

import anyio
import pytest
import skyrl_gym
from omegaconf import OmegaConf

from bunshin_async import InvalidArgument
from bunshin_async.integrations.skyrl import ENV_ID, BunshinTextEnv, EnvRuntime

from .conftest import Clean

TASK = {
    "files": {"calc.py": "def add(a, b):\n    return a - b\n"},
    "setup": ["echo set-up >> setup.log"],
    "reward_command": "python3 -c 'import calc; assert calc.add(2, 3) == 5'",
    "max_turns": 5,
}
PROMPT = [{"role": "user", "content": "fix add() in calc.py"}]


def _episode(env: BunshinTextEnv, actions: list[str]) -> list[dict[str, object]]:
    env.init(PROMPT)
    outs: list[dict[str, object]] = []
    try:
        for action in actions:
            out = env.step(action)
            outs.append(dict(out))
            if out["done"]:
                break
    finally:
        env.close()
    return outs


async def test_full_episode_through_make_and_group_forking(clean: Clean) -> None:
    runtime = EnvRuntime()
    try:
        config = OmegaConf.create({"timeout": 30})
        fix = ["<bash>cat calc.py</bash>", "<bash>sed -i 's/a - b/a + b/' calc.py</bash>", "I fixed it."]
        wrong = ["<bash>echo '# nothing' >> calc.py; cat setup.log</bash>", "done"]

        def episode(i: int) -> list[dict[str, object]]:
            env = skyrl_gym.make(ENV_ID, env_config=config, extras={**TASK, "group_id": "g1"})
            assert isinstance(env, BunshinTextEnv)
            env.runtime = runtime
            return _episode(env, fix if i % 2 == 0 else wrong)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = await anyio.to_thread.run_sync(lambda: list(pool.map(episode, range(4))))
        for i, outs in enumerate(results):
            final = outs[-1]
            assert final["done"] is True
            assert final["reward"] == (1.0 if i % 2 == 0 else 0.0), outs
            assert "exit code 0" in str(outs[0]["observations"])
        assert "return a - b" in str(results[0][0]["observations"])
        # Each member saw the set-up run once (its log was written before the fork), and forks are isolated: the
        # wrong fixes did not leak into the right ones and vice versa.
        assert results[1][0]["observations"] == [{"role": "user", "content": "exit code 0\nset-up\n"}]
        assert runtime.group_setups("g1") == 1
        assert runtime.live_workspaces == 0
    finally:
        await anyio.to_thread.run_sync(runtime.close_all)
    await clean()


async def test_max_turns_timeout_and_abandoned_envs_leave_no_workspace(clean: Clean) -> None:
    runtime = EnvRuntime()

    def run() -> None:
        env = BunshinTextEnv({"timeout": 0.5}, {**TASK, "max_turns": 2}, runtime=runtime)
        env.init(PROMPT)
        out = env.step("<bash>sleep 30</bash>")
        assert not out["done"] and "timed out after 0.5 s" in out["observations"][0]["content"]
        out = env.step("<bash>echo last</bash>")
        assert out["done"] and out["reward"] == 0.0 and "last" in out["observations"][0]["content"]
        with pytest.raises(InvalidArgument):
            env.init(PROMPT)
        env.close()
        env.close()
        # Abandoned mid-episode (a trainer's rollout timed out or was cancelled), with and without a group.
        for extras in ({**TASK}, {**TASK, "group_id": "g2"}):
            BunshinTextEnv({}, extras, runtime=runtime).init(PROMPT)
        assert runtime.live_workspaces == 2
        runtime.close_all()
        with pytest.raises(InvalidArgument):
            BunshinTextEnv({}, {}, runtime=runtime).step("<bash>true</bash>")

    try:
        await anyio.to_thread.run_sync(run)
    finally:
        await anyio.to_thread.run_sync(runtime.close_all)
    await clean()
