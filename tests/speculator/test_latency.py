"""Group latency offline (``speculator._latency``): a group waits for its slowest rollout, and the share of the
oracle's gain is computed as ``bench.experiment`` computes it from the groups' latencies."""

from __future__ import annotations

import pytest

from bench.experiment._runner import ConfigResult, _vs_fork_cache
from speculator._latency import RolloutTime, group_latency, latency_share

pytestmark = pytest.mark.unit


def test_a_second_hidden_off_the_straggler_does_not_shorten_its_group() -> None:
    straggler, other = RolloutTime(100.0), RolloutTime(90.0, hidden=8.0, tapped=9.0)
    assert group_latency([straggler, other]) == 100.0
    assert group_latency([RolloutTime(100.0, hidden=4.0, tapped=5.0), other]) == 95.0
    assert group_latency([RolloutTime(100.0, hidden=4.0, tapped=5.0), other], tap=False) == 96.0
    # hidden enough that another rollout is the slowest now: the group ends with that one
    assert group_latency([RolloutTime(100.0, hidden=30.0, tapped=30.0), other]) == 81.0
    assert group_latency([RolloutTime(100.0, hidden=30.0, tapped=30.0), other], speculative=False) == 100.0
    assert group_latency([]) == 0.0


def _result(name: str, groups: dict[str, float]) -> ConfigResult:
    return ConfigResult(name=name, group_latency_s=max(groups.values()), rollout_latency_s={}, setup_seconds=None,
                        peak_memory_mib=1, total_memory_gib_s=1, cpu_seconds=1, rollouts=[], sdk_cpu_seconds=1,
                        memory_timeline=[], group_latencies=groups)  # fmt: skip


def test_the_share_is_the_experiments_own_from_the_same_group_latencies() -> None:
    spec = {
        "a": [RolloutTime(100.0, 10.0, 12.0), RolloutTime(95.0)],  # the straggler passes its sibling: 95
        "b": [RolloutTime(80.0, 0.0, 1.0), RolloutTime(70.0, 5.0, 6.0)],  # hidden off the straggler: 79 by the tap
    }
    oracle = {
        "a": [RolloutTime(100.0, 20.0, 21.0), RolloutTime(95.0, 10.0, 11.0)],
        "b": [RolloutTime(80.0, 8.0, 9.0), RolloutTime(70.0, 1.0, 2.0)],
    }
    for tap in (False, True):
        share = latency_share(spec, oracle, tap=tap)

        def groups(rs: dict[str, list[RolloutTime]], speculative: bool = True, tap: bool = tap) -> dict[str, float]:
            return {t: group_latency(r, speculative=speculative, tap=tap) for t, r in rs.items()}

        runs = [[_result("fork+cache", groups(spec, False)), _result("fork+cache+spec", groups(spec)),
                 _result("oracle", groups(oracle))]]  # fmt: skip
        theirs = _vs_fork_cache(runs)["fork+cache+spec"]
        assert share.gain == pytest.approx(theirs["latency_gain"].median, abs=6e-4)  # rounded there
        assert share.oracle_gain == pytest.approx(theirs["oracle_latency_gain"].median, abs=6e-4)  # rounded there
        assert share.share == pytest.approx(theirs["latency_oracle_share"], abs=1e-3)
        assert share.mean_gain == pytest.approx(theirs["mean_group_latency_gain"].median, abs=6e-4)  # rounded there
        assert share.mean_share == pytest.approx(theirs["mean_group_latency_oracle_share"], abs=1e-3)
    # by hand, hits alone: fork+cache 100 and 80; spec 95 and 80; the oracle 85 and 72
    hits = latency_share(spec, oracle, tap=False)
    assert (hits.gain, hits.oracle_gain, hits.share) == (0.05, 0.15, pytest.approx(1 / 3, abs=1e-3))
    assert hits.mean_share == pytest.approx(2.5 / 11.5, abs=1e-3)  # means 90, 87.5 and 78.5


def test_runs_apart_pool_their_groups_and_an_oracle_that_gains_nothing_has_no_share() -> None:
    spec = {"a": [RolloutTime(100.0, 10.0, 10.0)], "b": [RolloutTime(50.0, 5.0, 5.0)]}
    oracle = {"a": [RolloutTime(100.0, 20.0, 20.0)], "b": [RolloutTime(50.0, 5.0, 5.0)]}
    together = latency_share(spec, oracle)
    assert together.gain == 0.1 and together.oracle_gain == 0.2  # the run waits for "a" alone
    apart = latency_share(spec, oracle, runs=[["a"], ["b"]])
    assert apart.gain == pytest.approx(15 / 150, abs=1e-4) and apart.oracle_gain == pytest.approx(25 / 150, abs=1e-4)
    assert apart.share == apart.mean_share == pytest.approx(0.6)
    none = latency_share(spec, {t: [RolloutTime(r[0].seconds)] for t, r in spec.items()})
    assert none.share is None and none.mean_share is None and none.oracle_gain == 0.0
