"""Group latency, as the experiment counts it, for the offline replay (``speculator._replay``).

A GRPO group waits for its slowest rollout, so a second hidden on any other rollout does not shorten it: what
speculation is worth is what it takes off each group's straggler, not the hidden seconds summed over rollouts.
``bench.experiment`` reports, against ``fork+cache``, the whole run's latency (its start to the last rollout of
its last group: with every group started at once, the slowest group's) and the mean over groups of each group's
latency, each configuration's gain (``1 - config / fork+cache``) and its share of the oracle's gain (its gain over
the oracle's). This module computes the same figures from what the replay knows of each rollout (``RolloutTime``).

Two things hide time on a speculative configuration's rollouts: the branches that hit, and the stream tap, which
starts every call (speculated or not) as soon as its arguments are complete, one inter-token interval before the
message's end (the replay server's ``separate_finish``). The tap is the same for every speculative configuration,
the oracle's included; ``tap=False`` leaves it out (what the predictors and the policy are worth alone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

__all__ = ["LatencyShare", "RolloutTime", "group_latency", "latency_share"]


class RolloutTime(msgspec.Struct, frozen=True):
    """One rollout as the replay saw it, seconds: ``seconds`` as ``fork+cache`` runs it (every turn's LLM time to
    its message's end, every call's run time but those the prefix cache serves), ``hidden`` what the branches
    that hit hid (``min(tool, LLM - fork seconds)`` each), ``tapped`` what hits and the stream tap hid together
    (``min(tool, lead + tap)`` per call: a hit's lead, 0 without one, plus the tap's interval)."""

    seconds: float
    hidden: float = 0.0
    tapped: float = 0.0

    def latency(self, *, tap: bool = True) -> float:
        """The rollout's end as a speculative configuration runs it (``tap``: the stream tap counted)."""
        return self.seconds - (self.tapped if tap else self.hidden)


def group_latency(rollouts: Sequence[RolloutTime], *, speculative: bool = True, tap: bool = True) -> float:
    """A group's latency: its slowest rollout's end (``speculative=False``: as fork+cache runs it, nothing
    hidden); 0 for a group with no rollout."""
    if not rollouts:
        return 0.0
    return max(r.latency(tap=tap) if speculative else r.seconds for r in rollouts)


class LatencyShare(msgspec.Struct, frozen=True):
    """A configuration against fork+cache and the oracle, as ``bench.experiment``'s ``vs_fork_cache`` gives it:
    ``gain`` and ``oracle_gain`` of the run's latency (1 - config / fork+cache), ``share`` of the oracle's gain
    captured (None where the oracle gains nothing), and the same of the mean group latency (``mean_*``)."""

    gain: float
    oracle_gain: float
    share: float | None
    mean_gain: float
    oracle_mean_gain: float
    mean_share: float | None


def _gain(base: float, new: float) -> float:
    return 1 - new / base if base > 0 else 0.0


def latency_share(
    config: Mapping[str, Sequence[RolloutTime]],
    oracle: Mapping[str, Sequence[RolloutTime]],
    *,
    runs: Sequence[Sequence[str]] | None = None,
    tap: bool = True,
) -> LatencyShare:
    """``config``'s and ``oracle``'s gains over fork+cache and the share captured, from each group's rollouts
    (task -> ``RolloutTime`` per rollout; both replays of the same traces, so their ``seconds`` agree).
    ``runs``: the groups each run held (default: all in one run, as the experiment runs them); a run's latency is
    its slowest group's, and the runs' gains are pooled (the sum of what each run gained over the sum of their
    latencies). ``tap``: count the stream tap in both configurations."""
    tasks = list(config)
    runs = [tasks] if runs is None else runs

    def pooled(latency: Mapping[str, float], base: Mapping[str, float], parts: Sequence[Sequence[str]]) -> float:
        before = sum(max(base[t] for t in run) for run in parts if run)
        after = sum(max(latency[t] for t in run) for run in parts if run)
        return _gain(before, after)

    base = {t: group_latency(config[t], speculative=False) for t in tasks}
    mine = {t: group_latency(config[t], tap=tap) for t in tasks}
    theirs = {t: group_latency(oracle[t], tap=tap) for t in tasks}
    gain, oracle_gain = pooled(mine, base, runs), pooled(theirs, base, runs)
    each = [[t] for t in tasks]
    mean_gain, oracle_mean_gain = pooled(mine, base, each), pooled(theirs, base, each)
    return LatencyShare(
        round(gain, 4),
        round(oracle_gain, 4),
        round(gain / oracle_gain, 3) if oracle_gain > 0 else None,
        round(mean_gain, 4),
        round(oracle_mean_gain, 4),
        round(mean_gain / oracle_mean_gain, 3) if oracle_mean_gain > 0 else None,
    )
