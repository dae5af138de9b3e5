"""What a speculated call holds in its fork beyond what it would hold on the main line, learned online by signature
(``tool:program``): the launch rule's ``call`` term (``MemoryTerms.call``).

A hit's call was taken to hold on the main line what it holds in the fork, only earlier. By the kernel's counters it
does not (docs/benchmarks/speculation-history.md, "Session 19"): on the long-tool groups the oracle's ``pip install``
calls (40 MiB each) ran 2.5-3.2 s in forks launched together at a turn's start, where the same calls ran 0.3-0.7 s on
fork+cache's main line, and calls a sibling had just run were run again in forks where the cache would have served them.
So a fork's call is charged what it is measured to hold in forks for the seconds it runs there beyond those it runs on
the main line (a call the cache serves runs there in the time of a restore).

What it holds is measured over time, not at its peak (session 21): the fork's cgroup charge above its charge when the
call started, sampled while it runs (``_runtime._probes.CallMeter``), in byte-seconds. Its peak (``call_peak``) says how
high it went, not for how long: a padded ``pip install`` (``bench.experiment --pad-tools``) holds its 40 MiB for a
second or two of its recorded 15 s and sleeps the rest, and was charged its peak for all 15
(docs/benchmarks/speculation-history.md, "Session 21"). A call holds in its first ``s`` seconds at most its peak for
``s`` seconds and at most what a whole run of its signature held (``held_over``)."""

from __future__ import annotations

from bunshin_async.speculation import CallKey

from ._memory import Ewma
from ._signature import key_signature

__all__ = ["CallMemory"]


class CallMemory:
    """Per signature: the bytes its calls held in forks and their seconds there (``observe_fork``), and their
    seconds on the main line (``observe_main``); ``measured`` once a fork's call has been. Bounded by the number of
    signatures (``tool:program``)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.bytes: dict[str, Ewma] = {}
        self.fork: dict[str, Ewma] = {}
        self.main: dict[str, Ewma] = {}
        self.held: dict[str, Ewma] = {}  # byte-seconds a run held in a fork (sampled), per signature
        self.all_bytes = Ewma(0.0)  # any signature's, for one not measured in a fork yet

    @property
    def measured(self) -> bool:
        return self.all_bytes.n > 0

    def observe_fork(self, key: CallKey, seconds: float, memory_bytes: int, byte_seconds: float = -1.0) -> None:
        """A call ran ``seconds`` in a fork (negative: cut short), raised its cgroup ``memory_bytes`` above its
        charge when it started (``_runtime._probes.call_peak``) and held ``byte_seconds`` above that charge over its
        run (``CallMeter``; negative: not measured). A run cut short held at least what it held until then: it
        raises its signature's byte-seconds, never lowers them, and alone it does not stand for a whole run (a
        ``pip install`` cut at the ask after a second had held 1-2 MiB·s of its ~30; session 21's online logs)."""
        sig = key_signature(key)
        held = self.held.get(sig)
        if byte_seconds >= 0 and (seconds >= 0 or (held is not None and byte_seconds > held.value)):
            self.held.setdefault(sig, Ewma(byte_seconds)).add(byte_seconds, self.alpha)
        if memory_bytes >= 0:
            self.bytes.setdefault(sig, Ewma(float(memory_bytes))).add(float(memory_bytes), self.alpha)
            self.all_bytes.add(float(memory_bytes), self.alpha)
        if seconds >= 0:
            self.fork.setdefault(sig, Ewma(seconds)).add(seconds, self.alpha)

    def observe_main(self, key: CallKey, seconds: float) -> None:
        """A call ran ``seconds`` on the main line (or was served there: by the cache, in a restore's time)."""
        if seconds >= 0:
            self.main.setdefault(key_signature(key), Ewma(seconds)).add(seconds, self.alpha)

    def size(self, key: CallKey) -> float | None:
        """The bytes calls of ``key``'s signature held in forks (None: none measured yet)."""
        sig = self.bytes.get(key_signature(key))
        return None if sig is None else sig.value

    def bytes_of(self, key: CallKey) -> float:
        """``size``, else any signature's (0 before any fork's call was measured)."""
        size = self.size(key)
        return self.all_bytes.value if size is None else size

    def held_over(self, key: CallKey, seconds: float) -> float | None:
        """Byte-seconds a call like ``key`` holds in a fork in its first ``seconds`` seconds: its signature's bytes
        for that long, at most what a whole run of its signature held (measured, ``observe_fork``). None: no call of
        its signature measured in a fork."""
        size = self.size(key)
        if size is None:
            return None
        held = self.held.get(key_signature(key))
        return size * seconds if held is None else min(size * seconds, held.value)

    def extra(self, key: CallKey, run: float) -> float:
        """Byte-seconds a call like ``key`` (expected to run ``run`` seconds) holds in a fork beyond what it holds on
        the main line, at least 0. Not run on the main line yet: its whole run in a fork (in forks, else ``run``:
        ``held_over``, else any signature's bytes that long) is charged, as a call the main line would not run (the
        cache serves it) is; run on both: what it holds on average in a fork (its byte-seconds over its seconds
        there, at most its bytes) x (its seconds in forks - on the main line); not run in a fork yet: nothing."""
        sig = key_signature(key)
        fork, main = self.fork.get(sig), self.main.get(sig)
        seconds = fork.value if fork is not None else run
        held = self.held_over(key, seconds)
        if main is None:
            return self.bytes_of(key) * seconds if held is None else held
        if fork is None:
            return 0.0
        mean = self.bytes_of(key) if held is None or seconds <= 0 else held / seconds
        return mean * max(0.0, fork.value - main.value)
