"""Seeded scripted agents: groups of rollouts that share a prefix then diverge, with small deterministic tool calls
(writes, reads, tool errors, background processes, several calls per message) and short LLM times."""

from __future__ import annotations

import random
from typing import Any

from bunshin_async.rollout import Step, Trajectory


def _call(rng: random.Random) -> tuple[str, dict[str, Any]]:
    k = rng.randrange(4)
    v = rng.choice(["alpha", "beta", "gamma", "delta"]) + str(rng.randrange(10))
    r = rng.random()
    if r < 0.12:
        return "bash", {"command": f"echo {v} > f{k}"}
    if r < 0.20:
        return "bash", {"command": f"echo {v} >> f{k} && wc -l f{k}"}
    if r < 0.27:
        return "bash", {"command": f"sleep 0.0{rng.randrange(3, 9)}; echo {v} > f{k}"}
    if r < 0.32:
        return "bash", {"command": f"mkdir -p d{k} && echo {v} > d{k}/g && ls d{k}"}
    if r < 0.36:
        return "bash", {"command": f"rm -f f{k}; ls"}
    if r < 0.40:
        return "bash", {"command": f"sed -i 's/a/A/' f{k}; cat f{k}"}
    if r < 0.44:
        return "bash", {"command": f"python3 -c \"open('p{k}','w').write('{v}')\" && cat p{k}"}
    if r < 0.47:
        return "write_file", {"path": f"w{k}.txt", "content": f"{v}\n"}
    if r < 0.49:
        return "bash", {"command": f"nohup sleep 10{k} > /dev/null 2>&1 &"}
    if r < 0.60:
        return "bash", {"command": f"cat f{k}"}
    if r < 0.68:
        return "bash", {"command": "ls"}
    if r < 0.74:
        return "bash", {"command": f"wc -c f{k} d{k}/g"}
    if r < 0.80:
        return "bash", {"command": f"grep -c a f{k}"}
    if r < 0.86:
        return "read_file", {"path": f"f{k}"}
    if r < 0.90:
        return "list_dir", {"path": "."}
    if r < 0.94:
        return "bash", {"command": f"head -1 f{k} p{k}"}
    return "bash", {"command": "cat f0 f1 | sort | uniq -c"}


def _turns(rng: random.Random, n: int) -> list[list[tuple[str, dict[str, Any]]]]:
    out = []
    for _ in range(n):
        size = 1 if rng.random() < 0.75 else rng.randrange(2, 4)
        out.append([_call(rng) for _ in range(size)])
    return out


def group(seed: int, rollouts: int) -> list[Trajectory]:
    """``rollouts`` trajectories of task ``g<seed>``: a shared script; rollout ``i`` follows it for a random number
    of turns, then goes its own way."""
    rng = random.Random(seed)
    base = _turns(rng, rng.randrange(3, 8))
    trajs = []
    for i in range(rollouts):
        r = random.Random(f"{seed}:{i}")
        keep = r.randrange(0, len(base) + 1)
        script = base[:keep] + _turns(r, r.randrange(0, 4))
        steps: list[Step] = []
        for t, calls in enumerate(script):
            llm = r.uniform(0.02, 0.05)
            for j, (name, args) in enumerate(calls):
                steps.append(Step(name, args, llm_seconds=llm if j == 0 else 0.0, turn=t))
        steps.append(Step(None, None, llm_seconds=0.02, assistant_text="done"))
        trajs.append(Trajectory(task_id=f"g{seed}", rollout=i, steps=steps))
    return trajs
