"""The speculation policy: which candidates to launch, by expected saving against cost, under a budget."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from bunshin_async.speculation import CallKey, Launch, LiveForks

from ._allowance import Allowance
from ._calibration import Calibration
from ._callmemory import CallMemory
from ._decisions import Decision, Verdict, decision
from ._memory import Ewma, ForkMemory
from ._signature import key_signature
from ._weighing import MemoryWeighing

__all__ = ["CostAwarePolicy", "cpu_contention", "loop_load"]


def cpu_contention() -> float:
    """How busy the CPUs are now, 0 (idle) to 1 (every CPU has a runnable task besides us): the kernel's count of
    runnable tasks (``/proc/loadavg``'s fourth field, instantaneous, this reader included) over the CPUs this
    process may use. Blocking but cheap (one read of a /proc file)."""
    try:
        with open("/proc/loadavg") as f:
            runnable = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    cpus = len(os.sched_getaffinity(0)) or 1
    return min(1.0, max(0, runnable - 1) / cpus)


class _LoopMeter(threading.local):
    def __init__(self) -> None:
        self.t, self.cpu, self.value = time.monotonic(), time.thread_time(), 0.0


_METER = _LoopMeter()
_LOOP_WINDOW = 1.0


def loop_load() -> float:
    """How busy the calling thread (the event loop's, where the policy runs) has been, 0 to 1: its CPU time over
    wall time, per window of at least a second, averaged over the last few windows. Two clock reads."""
    m, now = _METER, time.monotonic()
    if now - m.t >= _LOOP_WINDOW:
        cpu = time.thread_time()
        share = min(1.0, (cpu - m.cpu) / (now - m.t))
        m.value = 0.5 * (m.value + share)
        m.t, m.cpu = now, cpu
    return m.value


class _CallTimes:
    """What calls took on this machine, learned online: each exact call's run time (the ``max_calls`` run last), its
    signature's (``tool:program``) and the CPU seconds per second its signature took on the main line."""

    def __init__(self, alpha: float, max_calls: int) -> None:
        self.alpha, self.max_calls = alpha, max_calls
        self.exact: dict[CallKey, Ewma] = {}  # insertion-ordered: the least recently run first
        self.sig: dict[str, Ewma] = {}
        self.cpu: dict[str, Ewma] = {}

    def seconds(self, key: CallKey) -> float | None:
        exact = self.exact.get(key)
        if exact is not None:
            return exact.value
        sig = self.sig.get(key_signature(key))
        return sig.value if sig is not None else None

    def observe(self, key: CallKey, seconds: float) -> None:
        exact = self.exact.pop(key, None) or Ewma(seconds)
        exact.add(seconds, self.alpha)
        self.exact[key] = exact
        if len(self.exact) > self.max_calls:
            del self.exact[next(iter(self.exact))]
        self.sig.setdefault(key_signature(key), Ewma(seconds)).add(seconds, self.alpha)

    def observe_cpu(self, key: CallKey, cpu_seconds: float, seconds: float) -> None:
        if seconds >= 0.05 and cpu_seconds >= 0:
            share = cpu_seconds / seconds
            self.cpu.setdefault(key_signature(key), Ewma(share)).add(share, self.alpha)


class _Progress:
    """How many calls each running rollout has made, and its group (``Launch.group``): who is its group's
    straggler. ``size``: the most rollouts of each group seen running at once (a group that had siblings keeps a
    straggler when they ended), forgotten with its last rollout (a training run makes groups without end)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.group: dict[str, str] = {}
        self.size: dict[str, int] = {}

    def seen(self, rollout: str, calls: int, group: str) -> None:
        self.calls[rollout], self.group[rollout] = calls, group
        running = sum(1 for g in self.group.values() if g == group)
        self.size[group] = max(self.size.get(group, 0), running)

    def done(self, rollout: str) -> None:
        self.calls.pop(rollout, None)
        group = self.group.pop(rollout, None)
        if group is not None and group not in self.group.values():
            self.size.pop(group, None)

    def lag(self, rollout: str) -> float:
        """How far ``rollout`` is behind the other rollouts of its group still running, 0 (the front, or alone: a
        group of one has no straggler, whatever other groups share the policy) to 1 (the straggler, and the last
        of a group whose other rollouts ended: the group waits for it alone; on the terminal-bench traces, 133 of
        2,043 turn starts, against 51% of those furthest behind with others running)."""
        if rollout not in self.calls:
            return 0.0
        group = self.group.get(rollout, "")
        peers = [n for r, n in self.calls.items() if self.group.get(r, "") == group]
        if len(peers) < 2:
            return 1.0 if self.size.get(group, 0) >= 2 else 0.0
        lo, hi = min(peers), max(peers)
        return 1.0 if hi == lo else (hi - self.calls[rollout]) / (hi - lo)


class CostAwarePolicy(MemoryWeighing):
    """Launch a candidate when its expected saving beats its expected cost, best saving first.

    Saving: ``probability x min(expected run time, expected LLM time left in the turn)``: a branch can hide at most
    the model's remaining generation (the stream tap starts the call when its arguments are complete anyway).
    Expected run time: the exact call's own running average if it ran before, else its signature's
    (``tool:program``), else the candidate's ``expected_seconds``, else ``default_seconds``; the LLM time is the
    running average of the turns' (``observe_llm``; ``llm_seconds`` before the first), minus the turn's elapsed
    time (but at least a quarter of it: LLM times are heavy-tailed, a long turn tends to go on); all learned
    online. Cost: a fork's measured seconds (running average, ``fork_seconds`` before the first) times
    ``fork_weight``, or ``read_cost`` for an in-place read; plus the CPU a wrong guess takes from the rollouts that
    share the CPUs: ``(1 - probability) x expected run time x its CPU share x max(contention, min_contention) x
    cpu_weight``, contention being how busy the CPUs are now (``contention()``, 0..1, by default
    ``cpu_contention``; ``None``: CPU is not weighed) and the CPU share the CPU seconds per second its signature took
    on the main line (``observe_cpu``; 1 until measured): an install that mostly waits on the network, or a test that
    sleeps, takes little CPU however long it runs. ``min_contention`` (0.5) is there because a run's rollouts and
    its event loop share the CPUs even when the run queue is empty at the moment of the decision: a guess that
    computes must be right about one time in three before what its hits hide pays for what its misses burn, so
    where tool calls are short and the guesses long shots (a hit hides a 30 ms ``cat``) nothing is launched, while
    a long call that waits may still be a long shot.
    Memory, in the experiment's currency (GiB·s, here byte-seconds): a fork is launched only when what it saves
    pays for what it holds (``memory_net``, ``MemoryWeighing``), by bytes measured as the experiment counts them
    (``ForkMemory``, ``CallMemory``), or when its worse outcome fits the run's allowance (``memory_allows``);
    until a fork and a fork's call have been measured, one at a time, of a call expected to end before the ask. Reads in
    place hold nothing. ``decisions`` is told every verdict.
    On a saturated machine only likely guesses run (a coin flip never does), so speculation backs off instead of
    slowing the rollouts it serves. When the event loop itself is saturated (``loop_load()`` at least
    ``max_loop_load``: many rollouts, short tool calls) the policy is not ``active``: the runtime does not even ask
    the predictors, since every rollout waits on that one thread and a hidden tool call only adds to its work.
    Budgets: at most ``max_branches`` running, ``max_forks`` forks, and forks' estimated memory within
    ``memory_budget`` bytes. A fork that does not pay for its memory may still launch from the run's allowance:
    ``memory_share`` of the byte-seconds its rollouts held, less what its forks cost (``Allowance``; 0: never).
    One policy may serve many rollouts (share it to share what it
    learned); the per-call run times it keeps are those of the ``max_calls`` calls run last.

    Precision: the probability used is the candidate's times its predictor's observed calibration, capped at 1
    (``Calibration``: from every guess scored, ``observe_prediction``, then from the launched ones, ``release``).

    Chains: a launch ``depth`` calls deep pays with the chain's calibrated probability (``probability``) and can hide
    the rest of this turn's LLM time plus at most ``depth`` more turns' (it is asked for at least ``depth`` calls
    later); deeper than ``max_depth`` is never launched.

    Groups: rollouts that share the policy share ``group_forks`` forks in flight, and the one furthest behind its
    group (``Launch.group``; fewest calls made among the group's rollouts still running: a group's latency is its
    straggler's; a group of one has none, whatever other groups share the policy) is preferred: its
    expected gain counts ``1 + straggler_weight`` times (others' in proportion to how far behind they are), and
    the last ``straggler_reserve`` of the group's forks are its alone.
    """

    def __init__(
        self,
        *,
        max_branches: int = 4,
        max_forks: int = 2,
        memory_budget: int = 2 << 30,
        default_seconds: float = 0.3,
        fork_seconds: float = 0.2,
        fork_bytes: int = 32 << 20,
        fork_weight: float = 1.0,
        memory_weight: float = 1.0,
        memory_share: float = 0.1,
        read_cost: float = 0.006,
        min_probability: float = 0.05,
        prior_weight: float = 2.0,
        alpha: float = 0.3,
        llm_seconds: float = 3.0,
        cpu_weight: float = 1.0,
        min_contention: float = 0.5,
        contention: Callable[[], float] | None = cpu_contention,
        loop_load: Callable[[], float] | None = loop_load,
        max_loop_load: float = 0.8,
        max_depth: int = 2,
        group_forks: int = 6,
        straggler_weight: float = 1.0,
        straggler_reserve: int = 1,
        max_calls: int = 8192,
        rollout_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        decisions: Callable[[Decision], None] | None = None,
    ) -> None:
        self.max_branches = max_branches
        self.max_forks = max_forks
        self.memory_budget = memory_budget
        self.default_seconds = default_seconds
        self.fork_weight = fork_weight
        self.memory_weight = memory_weight
        self.read_cost = read_cost
        self.min_probability = min_probability
        self.precision = Calibration(prior_weight)
        self.alpha = alpha
        self.fork_seconds = Ewma(fork_seconds)
        m = self.memory = ForkMemory(float(fork_bytes), alpha, rollout_seconds, clock)
        self.fork_bytes, self.rollout_bytes, self.copy_extra = m.fork_bytes, m.rollout_bytes, m.copy_extra
        self.calls = CallMemory(alpha)
        self.allowance = Allowance(memory_share, clock)
        self.max_calls = max_calls
        self._times = _CallTimes(alpha, max_calls)
        self._llm_prior = llm_seconds
        self._llm_sum, self._llm_n = 0.0, 0
        self.cpu_weight = cpu_weight
        self.min_contention = min_contention
        self.contention = contention
        self.loop_load = loop_load
        self.max_loop_load = max_loop_load
        self._load = min_contention if contention is not None else 0.0  # read again at each select
        self.max_depth = max_depth
        self.group_forks = group_forks
        self.straggler_weight = straggler_weight
        self.straggler_reserve = straggler_reserve
        self._progress = _Progress()
        self.live = LiveForks()  # forks selected and not yet released (closing ones included), per rollout
        self.clock, self.decisions = clock, decisions
        self.verdicts: dict[str, int] = {}  # how many options each verdict had (``Verdict`` values)

    def expected_seconds(self, option: Launch) -> float:
        seen = self._times.seconds(option.key)
        if seen is not None:
            return seen
        if option.candidate.expected_seconds is not None:
            return option.candidate.expected_seconds
        return self.default_seconds

    def cpu_share(self, option: Launch) -> float:
        """CPU seconds per second of ``option``'s signature when it ran (1 until measured, at most 1: the contention
        term charges one CPU's worth at most)."""
        share = self._times.cpu.get(key_signature(option.key))
        return 1.0 if share is None else min(1.0, share.value)

    def lag(self, rollout: str) -> float:
        """How far ``rollout`` is behind the rest of its group, 0 (the front, or alone) to 1 (the straggler)."""
        return self._progress.lag(rollout)

    def calibration(self, source: str) -> float:
        return self.precision.factor(source)

    def probability(self, option: Launch) -> float:
        """The chance ``option`` is used: its candidate's calibrated probability times that of the launches it
        chains after (its ``parent``'s, calibrated the same way; ``prior`` where it has no parent)."""
        cand = option.candidate
        prior = self.probability(option.parent) if option.parent is not None else option.prior
        return prior * min(1.0, cand.probability * self.calibration(cand.source))

    def observe_prediction(self, source: str, probability: float, hit: bool) -> None:
        """``source``'s guesses for one decided call summed to ``probability``; ``hit``: one was the call."""
        self.precision.observe(source, probability, hit)

    def hideable(self, option: Launch) -> float:
        """Seconds of LLM time ``option`` can hide: what is left of this turn's (at least a quarter of a turn: LLM
        times are heavy-tailed, a long turn tends to go on), plus a turn per call it is chained after."""
        llm = self.llm_seconds
        return max(0.25 * llm, llm - option.turn_elapsed) + option.depth * llm

    def saving(self, option: Launch) -> float:
        """Expected seconds saved, net of cost (``select`` reads the CPU contention once per call into it)."""
        p = self.probability(option)
        run = self.expected_seconds(option)
        gain = p * min(run, self.hideable(option)) * (1 + self.straggler_weight * self.lag(option.rollout))
        cost = self.fork_seconds.value * self.fork_weight if option.needs_fork else self.read_cost
        cost += (1 - p) * run * self.cpu_share(option) * self._load * self.cpu_weight
        return gain - cost

    @property
    def load(self) -> float:
        """The CPU contention the last ``select`` charged a miss's CPU with."""
        return self._load

    def keeps(self, launch: Launch) -> bool:
        """Whether an unused branch for ``launch`` is worth handing to the next turn (``Speculation.keep``): the model
        asks for its call in a later turn if at all, so the fork is held at least that turn's LLM time (a turn more
        per call it is chained after) while it hides at most its run time: the launch rule (``memory_net``) with a
        turn that has just started, by itself (the allowance is not spent on a kept branch). A branch that fails it,
        or any fork before the rule has measured one, is let go (``TurnMetrics.released``). A read in the
        rollout's own workspace (no fork, no chain) holds nothing: it is kept, as ``select`` launches it unweighed."""
        if not launch.needs_fork and launch.parent is None:
            return True
        fresh = msgspec.structs.replace(launch, turn_elapsed=0.0)
        # unmeasured: let go (a kept fork holds its call's memory into turns nobody weighed: a missed install
        # of torch, the first fork of a run, held ~100 MiB for 20 s, 0.7x fork+cache's whole GiB·s; session 20)
        kept = not self.memory_weight or (self.weighs_measured and self.memory_net(fresh) >= 0)
        self._record(fresh, Verdict.KEEP if kept else Verdict.RELEASE, self.saving(fresh))
        return kept

    def active(self) -> bool:
        """Whether to consider launches now (the runtime asks before it asks the predictors): not while the event
        loop is saturated (``loop_load``)."""
        return self.loop_load is None or self.loop_load() < self.max_loop_load

    def select(self, options: Sequence[Launch], *, running: int, forks: int) -> list[Launch]:
        self._load = max(self.contention(), self.min_contention) if self.contention is not None else 0.0
        for o in options:
            if o.rollout:
                self._progress.seen(o.rollout, o.progress, o.group)
                self.memory.rollouts.seen(o.rollout)
        measured = self.rollout_bytes.n > 0  # the prior (a fork's 32 MiB) would earn what no rollout held
        self.allowance.observe_rollouts(len(self._progress.calls), self.rollout_bytes.value if measured else 0.0)
        ranked = sorted(((self.saving(o), o) for o in options), key=lambda x: -x[0])
        out: list[Launch] = []
        for gain, option in ranked:
            verdict = self._verdict(option, gain, running, forks)
            self._record(option, verdict, gain)
            if verdict is not Verdict.LAUNCH:
                continue
            if option.needs_fork:
                forks += 1
                self.live.add(option)
                if self.weighs_measured:  # a fork launched to measure is weighed by priors: not charged
                    self.allowance.charge(option, *self.outcome_costs(option))
            running += 1
            out.append(option)
        return out

    def _verdict(self, option: Launch, gain: float, running: int, forks: int) -> Verdict:
        """The first rule that refuses ``option`` (``Verdict``), or ``LAUNCH``."""
        if self.probability(option) < self.min_probability:
            return Verdict.PROBABILITY
        if option.depth > self.max_depth:
            return Verdict.DEPTH
        if gain <= 0:
            return Verdict.SAVING
        if running >= self.max_branches:
            return Verdict.BRANCHES
        if option.needs_fork:
            if forks >= self.max_forks or (forks + 1) * self.fork_bytes.value > self.memory_budget:
                return Verdict.FORKS
            if self.memory_weight and not self.weighs_measured:
                # no measure yet: one fork at a time, measured when it is ready, and only a call expected to end
                # before the ask (its cost unweighed, but bounded by the turn: a miss is cancelled at the ask)
                if self.live.total() or self.expected_seconds(option) > self.hideable(option):
                    return Verdict.MEASURING
            elif not self.memory_allows(option):
                return Verdict.MEMORY
            if not self._group_fork_allowed(option.rollout):
                return Verdict.GROUP
        return Verdict.LAUNCH

    def _record(self, option: Launch, verdict: Verdict, gain: float) -> None:
        self.verdicts[verdict.value] = self.verdicts.get(verdict.value, 0) + 1
        if self.decisions is not None:
            self.decisions(decision(self, option, verdict, gain))

    def _group_fork_allowed(self, rollout: str) -> bool:
        live = self.live.total()
        limit = self.group_forks if self.lag(rollout) >= 1.0 else self.group_forks - self.straggler_reserve
        return live < limit

    def release(self, launch: Launch, used: bool) -> None:
        """A branch this policy selected ended; ``used``: the main line took its result."""
        self.live.remove(launch)
        if launch.needs_fork:
            self.allowance.settle(launch, used)
        if used and launch.needs_fork:
            self.memory.committed(launch.rollout)
        self.precision.launched(launch.candidate.source, launch.probability, used)  # as stated: calibrated later

    def rollout_done(self, rollout: str) -> None:
        """``rollout`` ended: it no longer counts in its group's progress."""
        self._progress.done(rollout)
        self.live.forget(rollout)
        self.allowance.forget(rollout)
        self.memory.done(rollout)

    def observe_tool(self, key: CallKey, seconds: float) -> None:
        """A call ran ``seconds`` on the main line, or in place (a read)."""
        self._times.observe(key, seconds)
        self.calls.observe_main(key, seconds)

    def observe_call_seconds(self, key: CallKey, seconds: float) -> None:
        self._times.observe(key, seconds)

    def observe_cpu(self, key: CallKey, cpu_seconds: float, seconds: float) -> None:
        """A call run on the main line took ``cpu_seconds`` of CPU in ``seconds`` (calls under 50 ms say little)."""
        self._times.observe_cpu(key, cpu_seconds, seconds)

    @property
    def llm_seconds(self) -> float:
        """The expected LLM time of a turn: the mean of those observed, with the prior counted as three turns (one
        short turn says little: LLM times spread over an order of magnitude)."""
        return (3 * self._llm_prior + self._llm_sum) / (3 + self._llm_n)

    def observe_llm(self, seconds: float) -> None:
        """A turn's LLM time (request to the message's end), seconds."""
        if seconds > 0:
            self._llm_sum += seconds
            self._llm_n += 1
