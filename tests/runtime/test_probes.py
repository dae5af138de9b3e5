"""What the runtime charges a speculative fork (``_probes.fork_cost`` plus its snapshot layer, as ``BranchSet``
measures it) against what the run's accounting adds when the fork is taken: real workspaces and CRIU forks, read by
the kernel's counters (``Subtree.read``)."""

from __future__ import annotations

import anyio

from bunshin_async import Workspace
from bunshin_async._runtime._probes import fork_cost, making_bytes, memory_peak
from bunshin_async._workspace._accounting import accounting_scope, written_bytes

MIB = 1 << 20


async def test_a_small_forks_cost_is_what_the_accounting_adds_and_a_calls_passing_peak_counts() -> None:
    with accounting_scope("probes") as subtree:
        async with Workspace() as ws:
            await ws.exec("head -c 4194304 /dev/zero > /workspace/written")  # 4 MiB the fork's layer copies
            before = (await anyio.to_thread.run_sync(subtree.read)).memory_bytes
            [fork] = await ws.fork(1)
            try:
                ready = memory_peak(fork)  # the runtime reads it when the fork's call starts
                assert ready is not None
                await fork.exec("echo b > g")
                after = (await anyio.to_thread.run_sync(subtree.read)).memory_bytes
                _cpu, cost = await anyio.to_thread.run_sync(fork_cost, fork, ready)
                layer = await anyio.to_thread.run_sync(written_bytes, ws.directory)
                assert layer >= 4 * MIB
                added = after - before
                # charged about as the accounting counts it: the fork's image and processes plus the layer of what
                # its base wrote (not counted: the snapshot's small image files, and the rollout's own pages move a
                # little between two readings)
                assert 0.75 * added <= cost + layer <= 1.25 * added, (cost, layer, added)
                # the cgroup's peak alone (the restore's own charge) said several times what the fork holds
                _cpu, peaked = await anyio.to_thread.run_sync(fork_cost, fork)
                assert peaked > cost, (peaked, cost)
                # memory a call held only for a while is still charged: it was held beside the rollout
                await fork.exec(["python3", "-c", "x = bytearray(32 << 20); x[::4096] = b'1' * len(x[::4096])"])
                _cpu, passing = await anyio.to_thread.run_sync(fork_cost, fork, ready)
                assert passing >= cost + 30 * MIB, (passing, cost)
            finally:
                await fork.aclose()


def test_a_forks_making_is_charged_beyond_the_fork_itself() -> None:
    """The launch rule charges a fork's own bytes for its whole hold, its making included: the making term is what
    the cgroup's peak (CRIU's restore among it) held beyond the charge the fork then had (review19: the peak alone
    counted the fork's own bytes twice). Pure arithmetic, no workspace."""
    assert making_bytes(5 * MIB, 2 * MIB) == 3 * MIB
    assert making_bytes(2 * MIB, 2 * MIB) == 0
    assert making_bytes(1 * MIB, 2 * MIB) == 0  # a charge above the peak read a moment before: nothing
    assert making_bytes(None, 2 * MIB) == 0 and making_bytes(5 * MIB, None) == 0  # no memory controller
