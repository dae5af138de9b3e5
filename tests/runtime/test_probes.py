"""What the runtime charges a speculative fork (``_probes.fork_cost`` plus its snapshot layer, as ``BranchSet``
measures it) against what the run's accounting adds when the fork is taken: real workspaces and CRIU forks, read by
the kernel's counters (``Subtree.read``)."""

from __future__ import annotations

import threading

import anyio
import pytest

from bunshin_async import Workspace
from bunshin_async._runtime import _probes
from bunshin_async._runtime._probes import (
    CallMeter,
    call_peak,
    fork_cost,
    held_charge,
    making_bytes,
    memory_peak,
    memory_usage,
)
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


async def test_a_calls_byte_seconds_count_how_long_it_held_its_memory_not_only_how_high(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CallMeter`` integrates what the cgroup holds above the call's start while the call runs: a call that holds 32
    MiB for half a second and then sleeps two (as a ``--pad-tools`` call sleeps after its command) is charged about
    its half second, where its peak (``call_peak``) held for its whole run says four times that or more. Bounded by
    the peak for the run; the sampler is cancelled with the call. Its readings of ``memory.stat`` (0.1-0.2 ms each)
    are made in worker threads."""
    async with Workspace() as ws:
        clock = anyio.current_time
        ready_peak, base = memory_peak(ws), memory_usage(ws)
        assert base is not None
        meter = CallMeter(ws, clock)
        readers = []

        def reading(w: Workspace) -> int | None:
            readers.append(threading.current_thread() is threading.main_thread())
            return held_charge(w)

        monkeypatch.setattr(_probes, "held_charge", reading)
        hold = "x = bytearray(32 << 20); x[::4096] = b'1' * len(x[::4096]); import time; time.sleep(0.5)"
        start = clock()
        result = await meter.during(lambda: ws.exec(["sh", "-c", f'python3 -c "{hold}"; sleep 2']))
        seconds = clock() - start
        assert result.exit_code == 0
        peak = call_peak(ws, ready_peak, base)
        assert peak >= 30 * MIB, peak
        assert 0 < meter.byte_seconds <= peak * seconds
        assert meter.byte_seconds < 0.75 * peak * seconds, (meter.byte_seconds / MIB, peak / MIB, seconds)
        assert meter.byte_seconds >= 0.1 * 30 * MIB  # its half second held was seen
        assert len(readers) >= 3 and not any(readers)  # read in worker threads, not on the event loop
        stopped = meter.byte_seconds
        meter.sample()
        assert meter.byte_seconds == stopped  # stopped with its call


def test_a_meter_without_a_memory_controller_measures_nothing() -> None:
    """No reading (no memory controller): -1, which the policy reads as not measured."""

    class _NoMemory:  # a workspace whose cgroup has no memory controller
        cgroup = None

    meter = CallMeter(_NoMemory(), lambda: 0.0)  # type: ignore[arg-type]
    meter.sample()
    meter.stop()
    assert meter.byte_seconds == -1.0
