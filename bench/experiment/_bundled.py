"""The bundled workload: a small Python project with a bug, and GRPO-shaped scripted rollouts of it.

Rollouts of one group share an exact prefix (list the files, read the README, install the dependency, run the
reproduction script: the slow, state-changing calls that dominate reused tool time in public traces) and then
diverge into fix attempts, some right and some wrong, with the proportions of ../shared/traces: edits by sed or
heredoc, reads, test runs, a submit. LLM time per turn is drawn from a seeded log-normal around the traces' median.
"""

from __future__ import annotations

import random
from pathlib import Path

from bunshin_async._rollout._rollout import Task
from bunshin_async._rollout._trajectory import Step, Trajectory

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
PY = ".venv/bin/python"

BUGGY_MEAN = "sum(xs) / (len(xs) - 1)"
# What a correct fix leaves behind: the task's own module with the off-by-one mended.
FIXED_MODULE = (TASKS_DIR / "calc" / "statkit" / "__init__.py").read_text().replace(BUGGY_MEAN, "sum(xs) / len(xs)")


def calc_task(kernel_mib: int = 96) -> Task:
    """The bundled task. Set-up (once per group with fork, once per rollout without): a virtualenv and a warm
    interpreter holding ``kernel_mib`` MiB of the project's data, as an agent's REPL or language server would."""
    root = TASKS_DIR / "calc"
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    return Task(
        task_id="calc",
        prompt="The summary printed by repro.py is wrong. Find the bug in statkit and fix it; the tests must pass.",
        files=files,
        setup=["python3 -m venv --system-site-packages .venv"],
        background=[f"python3 warm_kernel.py 0 {kernel_mib}"],
        ready=["grep -q 'kernel ready' .bunshin-bg-0.log"],
        reward_command=f"{PY} -m unittest -q",
    )


PREFIX = [
    "ls -la",
    "cat README.md",
    f"{PY} -m pip install -q --no-index --no-build-isolation ./vendor/tablefmt",
    f"{PY} repro.py",
]

SED_FIX = f"sed -i 's|{BUGGY_MEAN}|sum(xs) / len(xs)|' statkit/__init__.py"
HEREDOC_FIX = f"cat > statkit/__init__.py <<'EOF'\n{FIXED_MODULE}EOF"
WRONG_FIX = "sed -i 's|(len(xs) - 1)|(len(xs) + 1)|' statkit/__init__.py"
TESTS = f"{PY} -m unittest -q"

VARIANTS = [
    ["cat statkit/__init__.py", SED_FIX, f"{PY} repro.py", TESTS],
    ["grep -n 'len(xs)' statkit/__init__.py", HEREDOC_FIX, TESTS],
    [
        "nl -ba statkit/__init__.py",
        WRONG_FIX,
        TESTS,
        "git diff --no-index /dev/null statkit/__init__.py | head -20",
        SED_FIX.replace("(len(xs) - 1)", "(len(xs) + 1)"),
        TESTS,
    ],
    ["cat tests/test_statkit.py", "cat statkit/__init__.py", SED_FIX, TESTS, f"{PY} repro.py"],
]


def calc_trajectories(n: int, seed: int = 0, llm_median: float = 1.0, sigma: float = 0.5) -> list[Trajectory]:
    """``n`` scripted rollouts of the calc task: the shared prefix, then a seeded choice of fix attempt."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        variant = VARIANTS[rng.randrange(len(VARIANTS))]
        commands = PREFIX + variant
        steps = [
            Step(tool="bash", args={"command": c}, llm_seconds=round(rng.lognormvariate(0, sigma) * llm_median, 3))
            for c in commands
        ]
        steps.append(
            Step(
                tool=None,
                assistant_text="Fixed the off-by-one in mean().",
                llm_seconds=round(rng.lognormvariate(0, sigma) * llm_median, 3),
            )
        )
        out.append(Trajectory(task_id="calc", rollout=i, steps=steps))
    return out
