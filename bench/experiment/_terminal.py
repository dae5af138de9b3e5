"""The terminal workload: shaped like timed multi-rollout traces of a terminal benchmark (../shared/traces/README.md).

A small Python project (``tasks/terminal``: a CSV summarizer with an off-by-one, two vendored dependencies not yet
installed, a build step and a benchmark). Rollouts of one group share the first three calls (list the files, read
the README, run the tests, which fail with ``ModuleNotFoundError: No module named 'fastcsv'``) and then diverge:
each installs the dependencies its own way (one at a time after each import error, or both at once, spelled as
people do), re-runs the same test command after every install and edit, fixes the bug (sometimes wrongly first),
then builds and benchmarks. The slow calls (real ``pip install``s from the vendored sources, test runs, a CPU-bound
build and benchmark) are state-changing and predictable from context (the module an import error names, the test
command after an edit, the benchmark after the build) but not from the shared prefix. Tools really execute; they
are padded only when ``--pad-tools`` asks (see ``PADS``). LLM time per turn is a seeded log-normal with the traces'
median (3.3 s) and spread (sigma 1.0: mean ~5.4 s, p90 ~12 s), capped at 30 s; ``time_scale`` of the experiment
scales it (and the pads).
"""

from __future__ import annotations

import random

from bunshin_async._rollout._rollout import Task
from bunshin_async._rollout._trajectory import Step, Trajectory

from ._bundled import TASKS_DIR

PY = ".venv/bin/python"
TESTS = f"{PY} -m unittest -q"
PIP = f"{PY} -m pip install -q --no-index --no-build-isolation"
PIP2 = ".venv/bin/pip install -q --no-index --no-build-isolation"
BUILD = f"{PY} build.py"
BENCH = f"{PY} bench.py"
FIX = "sed -i 's/rows\\[2:\\]/rows[1:]/' csvtool/core.py"
WRONG_FIX = "sed -i 's/rows\\[2:\\]/rows[0:]/' csvtool/core.py"
RIGHT_AFTER_WRONG = "sed -i 's/rows\\[0:\\]/rows[1:]/' csvtool/core.py"
CORE = (TASKS_DIR / "terminal" / "csvtool" / "core.py").read_text()
HEREDOC_FIX = f"cat > csvtool/core.py <<'EOF'\n{CORE.replace('rows[2:]', 'rows[1:]')}EOF"

PREFIX = ["ls -la", "cat README.md", TESTS]

VARIANTS = [
    # one install per import error, the README's spelling
    [f"{PIP} ./vendor/fastcsv", TESTS, f"{PIP} ./vendor/colstats", TESTS, "cat csvtool/core.py", FIX, TESTS, BUILD,
     BENCH],
    # reads first, pip's own script
    ["cat csvtool/core.py", f"{PIP2} vendor/fastcsv", TESTS, f"{PIP2} vendor/colstats", TESTS, FIX, TESTS, BUILD,
     BENCH],
    # both dependencies at once, a heredoc fix
    ["grep -n import csvtool/core.py", f"{PIP} ./vendor/fastcsv ./vendor/colstats", TESTS, HEREDOC_FIX, TESTS, BUILD,
     BENCH],
    # a wrong fix first, then the right one
    [f"{PIP} ./vendor/fastcsv", TESTS, f"{PIP} ./vendor/colstats", TESTS, WRONG_FIX, TESTS, RIGHT_AFTER_WRONG, TESTS,
     BUILD, BENCH],
]  # fmt: skip


# With ``--pad-tools``, each call runs for real and then sleeps up to a duration drawn, once per command, from a
# log-normal with the timed traces' per-kind median (../shared/traces/README.md): real installs there download
# (median 28.5 s, 37% of tool time), tests take 1.2 s, and 13% of calls take over 10 s (here the build and the
# benchmark). Unpadded, the vendored installs take 1-2 s and tools are ~6% of a rollout's time, against the traces'
# 39%: too little for any tool-latency mechanism to show.
PADS = {"install": 28.5, "test": 1.2, "long run": 10.0}
PAD_SIGMA = 0.5


def call_kind(command: str) -> str | None:
    """The kind whose duration a padded run of ``command`` takes, or None (not padded)."""
    if "pip install" in command:
        return "install"
    if command == TESTS:
        return "test"
    if command in (BUILD, BENCH):
        return "long run"
    return None


def padded_seconds(command: str) -> float:
    """The padded duration of ``command`` (the same in every rollout and configuration: seeded by the command)."""
    kind = call_kind(command)
    if kind is None:
        return 0.0
    return round(min(120.0, PADS[kind] * random.Random(command).lognormvariate(0.0, PAD_SIGMA)), 3)


def terminal_task(kernel_mib: int = 64, *, work: float = 1.0) -> Task:
    """The terminal task. Set-up: a virtualenv and a warm interpreter holding ``kernel_mib`` MiB (an agent's REPL).
    ``work`` scales the CPU work of the build and the benchmark (smoke runs use less)."""
    root = TASKS_DIR / "terminal"
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    if work != 1.0:
        files["build.py"] = files["build.py"].replace(b"range(60)", f"range({max(1, round(60 * work))})".encode())
        files["bench.py"] = files["bench.py"].replace(b"700000", str(max(1, round(700000 * work))).encode())
    return Task(
        task_id="terminal",
        prompt="csvtool reports wrong means. Install what it needs, fix the bug, make the tests pass, then build and "
        "benchmark it.",
        files=files,
        setup=["python3 -m venv --system-site-packages .venv"],
        background=[f"python3 -c 'import os, time; x = os.urandom({kernel_mib} << 20); print(\"kernel ready\", "
                    "flush=True); time.sleep(1e6)'"],
        ready=["grep -q 'kernel ready' .bunshin-bg-0.log"],
        reward_command=f"{TESTS} && test -s build/index.json",
    )  # fmt: skip


def llm_seconds(rng: random.Random, median: float = 3.3, sigma: float = 1.0, cap: float = 30.0) -> float:
    return round(min(cap, median * rng.lognormvariate(0.0, sigma)), 3)


def terminal_trajectories(n: int, seed: int = 0, llm_median: float = 3.3, sigma: float = 1.0) -> list[Trajectory]:
    """``n`` scripted rollouts: the shared prefix, then variant ``(seed + i) % 4`` (every variant appears in a group
    of four)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        commands = PREFIX + VARIANTS[(seed + i) % len(VARIANTS)]
        steps = [Step(tool="bash", args={"command": c}, llm_seconds=llm_seconds(rng, llm_median, sigma))
                 for c in commands]  # fmt: skip
        steps.append(Step(tool=None, assistant_text="Installed the dependencies, fixed summarize(), built and "
                          "benchmarked.", llm_seconds=llm_seconds(rng, llm_median, sigma)))  # fmt: skip
        out.append(Trajectory(task_id="terminal", rollout=i, steps=steps))
    return out
