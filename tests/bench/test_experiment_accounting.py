"""The experiment's accounting against an independent sampler: every configuration's GiB·s, peak memory and CPU agree
within 5% with ``_sampler.Sampler``, which reads /proc and the cgroup files directly over the whole cgroup parent and
snapshot store of this test run (so it sees whatever the configuration made, tracked by anyone or not).

The workload makes the cases the old per-workspace accounting missed: a slow write that speculation commits (the
rollout moves into the branch's fork) or the cache serves by restoring a fork, after which the rollout allocates
memory and burns CPU in a short-lived process."""

from __future__ import annotations

import pytest

from bench.experiment._runner import run_experiment
from bunshin_async.rollout import Step, Task, Trajectory

from ._sampler import Sampler, compare, disagreements

pytestmark = [pytest.mark.root, pytest.mark.slow]

HOLD_MIB = 96
WRITE_MIB = 32
# Writes WRITE_MIB MiB to a file in the workspace (its upper dir: a tmpfs no process maps, which no PSS shows),
# allocates and touches HOLD_MIB MiB, burns a fixed amount of CPU (not a wall-clock time: the machine is shared),
# then holds the memory a while and exits: its CPU is only in the cgroup's counter once it is gone. Two samplers
# disagree where memory changes between their samples: the hold is long against a sample's spacing on a busy machine.
ALLOCATE = (
    f'python3 -c \'open("written.bin", "wb").write(b"\\2" * ({WRITE_MIB} << 20)); '
    f'x = bytearray({HOLD_MIB} << 20); x[::4096] = b"\\1" * len(x[::4096]); '
    "sum(range(15_000_000)); import time; time.sleep(8)'"  # an argument follows (ignored)
)
SLOW_WRITE = "sleep 1.2; echo x > f"


def _step(command: str, llm: float) -> Step:
    return Step("bash", {"command": command}, llm_seconds=llm, tool_seconds=1.0)


@pytest.mark.timeout(900)
async def test_a_committed_write_then_memory_and_cpu_are_counted_in_every_configuration() -> None:
    """Each rollout: a slow write (committed from a speculative fork in the oracle, served by a restored fork
    from the cache's capture in a sibling), then a process that allocates HOLD_MIB MiB and burns CPU in the
    rollout's workspace, whichever fork that is now. Every configuration counts it: at least the rollouts' memory
    at its peak, and GiB·s, peak and CPU within 5% of the independent sampler."""
    task = Task(task_id="acct", prompt="allocate")
    done = Step(None, None, llm_seconds=0.05, assistant_text="done")
    trajs = [
        Trajectory(task_id="acct", rollout=i, steps=[_step(SLOW_WRITE, 0.05), _step(f"{ALLOCATE} {i}", 1.5), done])
        for i in range(2)  # the siblings' allocations differ: each runs its own, at the same time
    ]
    # What is counted once a branch commits is the point here: the policy's GiB·s rule (a fork pays only when its
    # hidden seconds outweigh what it holds) would launch nothing on these few-MiB workspaces, so the speculative
    # configurations run without it ('-unweighed-forks').
    configs = ["baseline", "fork", "fork+cache", "fork+cache+spec-unweighed-forks", "oracle-unweighed-forks"]
    with Sampler() as sampler:
        result = await run_experiment([(task, trajs)], configs=configs, progress=sampler.progress)
    assert result.same_calls_and_results, result.differences
    disagree = disagreements(compare(result, sampler))
    by_name = {c.name: c for c in result.configs}
    assert by_name["oracle-unweighed-forks"].extra["spec"]["committed"] >= 2  # the write, then the allocation, in forks
    for c in result.configs:
        assert [r.status for r in c.rollouts] == ["finished", "finished"], c.name
        assert c.peak_memory_mib >= 2 * (HOLD_MIB + WRITE_MIB), (c.name, c.peak_memory_mib)
    assert not disagree, disagree
