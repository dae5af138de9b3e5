"""SkyRL-gym episodes in Bunshin workspaces: four samples of one prompt share one set-up (a group fork).

    python examples/skyrl_episode.py

Needs root (workspaces) and ``pip install 'bunshin[skyrl]'``.
"""

from __future__ import annotations

import concurrent.futures

import skyrl_gym

from bunshin_async.integrations.skyrl import ENV_ID, default_runtime

EXTRAS = {
    "files": {"calc.py": "def add(a, b):\n    return a - b\n"},
    "setup": ["python3 -m venv .venv"],  # the expensive part, done once for the group
    "reward_command": ".venv/bin/python -c 'import calc; assert calc.add(2, 3) == 5'",
    "group_id": "prompt-0",
    "max_turns": 4,
}
POLICIES = [  # what four samples of a policy might answer
    ["<bash>cat calc.py</bash>", "<bash>sed -i 's/a - b/a + b/' calc.py</bash>", "Fixed."],
    ["<bash>ls</bash>", "Looks fine to me."],
    ["<bash>sed -i 's/a - b/b + a/' calc.py</bash>", "Done."],
    ["<bash>sed -i 's/return a - b/return a * b/' calc.py</bash>", "Done."],
]


def episode(actions: list[str]) -> float:
    env = skyrl_gym.make(ENV_ID, env_config={"timeout": 60}, extras=EXTRAS)
    try:
        env.init([{"role": "user", "content": "Fix add() in calc.py."}])
        for action in actions:
            out = env.step(action)
            if out["done"]:
                return float(out["reward"])
        return 0.0
    finally:
        env.close()


if __name__ == "__main__":
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rewards = list(pool.map(episode, POLICIES))
    print("rewards:", rewards, "| set-ups run for the group:", default_runtime().group_setups("prompt-0"))
    default_runtime().close_all()
