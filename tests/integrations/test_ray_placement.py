"""The Ray integration's placement, pure: where a group's rollouts go (``plan_group``) and which host a new
workspace goes to (``roomiest``), over plain ``HostInfo`` values, without Ray, root or a workspace (the cluster
tests, tests/ray, run them over a real two-node cluster)."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from bunshin_async import HostError
from bunshin_async.integrations._ray._model import DEFAULT_BANDWIDTH, HostInfo
from bunshin_async.integrations._ray._placement import (
    Ledger,
    mean_update,
    plan_group,
    room,
    roomiest,
    with_bandwidth,
)

pytestmark = pytest.mark.unit


def info(name: str, in_use: int = 0, bw: float | None = None, *, slots: int = 4, waiting: int = 0) -> HostInfo:
    return HostInfo(
        name=name, node_id=name, hostname="h", pid=1, max_workspaces=slots, in_use=in_use, waiting=waiting,
        workspaces=in_use, snapshots=0, bandwidth={} if bw is None else {"a": bw}, memory_bytes=0,
    )  # fmt: skip


def placements(plan: list) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return [(p.host, p.placement) for p in plan]


def test_plan_stays_on_the_base_host_while_it_has_room_then_weighs_ship_against_setup() -> None:
    fast = plan_group(8, "a", [info("a"), info("b", bw=1e9)], snapshot_bytes=200 << 20, setup_seconds=5,
                      rollout_seconds=10)  # fmt: skip
    assert placements(fast) == [("a", "base")] * 4 + [("b", "shipped")] * 4
    slow = plan_group(8, "a", [info("a"), info("b", bw=1e6)], snapshot_bytes=200 << 20, setup_seconds=5,
                      rollout_seconds=10)  # fmt: skip
    assert placements(slow)[4:] == [("b", "re-setup")] * 4
    short = plan_group(8, "a", [info("a"), info("b", bw=1e6)], snapshot_bytes=200 << 20, setup_seconds=50,
                       rollout_seconds=1)  # fmt: skip
    assert {p.host for p in short} == {"a"}  # queueing on the base host is cheaper than either
    full = plan_group(4, "a", [info("a", in_use=4), info("b", bw=1e9)], snapshot_bytes=1 << 20,
                      setup_seconds=5, rollout_seconds=10)  # fmt: skip
    assert {p.host for p in full} == {"b"}


def test_the_snapshot_reaches_a_host_once_and_later_rollouts_there_restore_it() -> None:
    plan = plan_group(12, "a", [info("a"), info("b", bw=1e9), info("c", bw=1e9)], snapshot_bytes=100 << 20,
                      setup_seconds=30, rollout_seconds=60)  # fmt: skip
    by_host: dict[str, list[str]] = {}
    for p in plan:
        by_host.setdefault(p.host, []).append(p.placement)
    assert by_host == {"a": ["base"] * 4, "b": ["shipped"] * 4, "c": ["shipped"] * 4}
    # every rollout after the first on b weighs only the restore there: the snapshot is not shipped twice
    later_b = [p for p in plan if p.host == "b"][1:]
    assert all("b:shipped" in p.estimates and "b:re-setup" not in p.estimates for p in later_b)
    assert [p.rollout for p in plan] == list(range(12))


def test_each_rollout_takes_the_cheapest_estimate_and_ties_go_to_the_base_host() -> None:
    plan = plan_group(6, "b", [info("a", bw=1e9), info("b")], snapshot_bytes=0, setup_seconds=0,
                      rollout_seconds=1, restore_seconds=0.0)  # fmt: skip
    for p in plan:
        assert p.estimates[f"{p.host}:{p.placement}"] == min(p.estimates.values())
    # a's shipping costs nothing here: the first four still go to the base host b (a tie), then a's free slots win
    assert placements(plan)[:4] == [("b", "base")] * 4 and plan[4].host == "a"


def test_queueing_counts_full_rounds_of_a_hosts_slots() -> None:
    plan = plan_group(9, "a", [info("a", slots=2)], snapshot_bytes=0, setup_seconds=0, rollout_seconds=10,
                      restore_seconds=0.0)  # fmt: skip
    assert [p.estimates["a:base"] for p in plan] == [0, 0, 10, 10, 20, 20, 30, 30, 40]


def test_pending_and_waiting_workspaces_take_slots_the_host_does_not_count_yet() -> None:
    hosts = [info("a", in_use=1, waiting=1), info("b", bw=1e9)]
    assert room(hosts[0], {}) == 2 and room(hosts[0], {"a": 3}) == -1
    plan = plan_group(2, "a", hosts, snapshot_bytes=1 << 20, setup_seconds=5, rollout_seconds=10,
                      pending={"a": 2})  # fmt: skip
    assert {p.host for p in plan} == {"b"}  # a is full once what this client placed there is counted


def test_a_reservation_counts_until_its_host_lists_its_claim_never_twice() -> None:
    ledger = Ledger()
    a, b = ledger.reserve("a"), ledger.reserve("b", 3)
    hosts = [info("a"), info("b")]
    assert ledger.pending(hosts) == {"a": 1, "b": 3} and len(ledger) == 2
    # a's host made the workspace (in use) and the reply is on its way: a's info counts it and lists the claim
    made = msgspec.structs.replace(hosts[0], in_use=1, claims=(a,))
    assert ledger.pending([made, hosts[1]]) == {"b": 3}
    assert room(made, ledger.pending([made, hosts[1]])) == 3  # once, not 2 (in use and reserved)
    # another client's claims, or one listed by another host, do not count for this one
    assert ledger.pending([msgspec.structs.replace(hosts[0], claims=("other", b)), None]) == {"a": 1, "b": 3}
    ledger.release(a)
    ledger.release(a)  # idempotent
    assert ledger.pending([made, hosts[1]]) == {"b": 3}
    ledger.release(b)
    assert ledger.pending(hosts) == {} and len(ledger) == 0


def test_unmeasured_links_assume_the_default_bandwidth() -> None:
    size = int(DEFAULT_BANDWIDTH * 3)  # 3 s to ship at the default rate, against a 5 s set-up
    plan = plan_group(5, "a", [info("a"), info("b")], snapshot_bytes=size, setup_seconds=5, rollout_seconds=100,
                      restore_seconds=0.0)  # fmt: skip
    assert plan[4].placement == "shipped" and plan[4].estimates["b:shipped"] == pytest.approx(3.0)
    assert plan[4].estimates["b:re-setup"] == 5.0


def test_a_bandwidth_override_replaces_the_measured_one() -> None:
    b = info("b", bw=1e9)
    assert with_bandwidth(b, "a", {"b": 1000.0}).bandwidth == {"a": 1000.0}
    assert with_bandwidth(b, "a", {"c": 1000.0}) is b
    plan = plan_group(8, "a", [info("a"), with_bandwidth(b, "a", {"b": 1000.0})], snapshot_bytes=1 << 30,
                      setup_seconds=5, rollout_seconds=60)  # fmt: skip
    assert placements(plan)[4:] == [("b", "re-setup")] * 4


def test_a_new_workspace_goes_to_the_live_host_with_the_most_room() -> None:
    hosts = [info("a", in_use=3), None, info("c", in_use=1), info("d", in_use=1)]
    assert roomiest(hosts, {}) == 2  # c and d tie: the first
    assert roomiest(hosts, {"c": 1}) == 3
    assert roomiest([None, None], {}) is None
    assert roomiest([info("a", in_use=4), info("b", in_use=4, waiting=2)], {}) == 0  # over-committed: least so


def test_running_means() -> None:
    assert mean_update(None, 4.0, 0.2) == 4.0
    assert mean_update(10.0, 20.0, 0.2) == pytest.approx(12.0)
    assert mean_update(10.0, 20.0, 0.5) == pytest.approx(15.0)


def test_placement_needs_no_ray() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from bunshin_async.integrations._ray import _placement, _model, _holdings\n"
        "print(_placement.plan_group(1, 'a', [_model.HostInfo('a', 'a', 'h', 1, 1, 0, 0, 0, 0, {}, 0)],\n"
        "                            snapshot_bytes=0, setup_seconds=0, rollout_seconds=0)[0].placement)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (0, "base\n"), out.stderr


def test_no_live_host_is_a_host_error() -> None:
    with pytest.raises(HostError, match="no live host"):
        plan_group(1, "a", [], snapshot_bytes=0, setup_seconds=0, rollout_seconds=0)
