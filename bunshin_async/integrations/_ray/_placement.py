"""Where a group's rollouts and a new workspace go: pure functions over ``HostInfo`` (no Ray, no workspace; unit
tested in tests/integrations/test_ray_placement.py).

The cost model (``plan_group``). A group's set-up runs once on the host with the most room, which snapshots it (the
base snapshot). Each rollout then goes where its estimated start is earliest: on the base host while it has free
slots (a restore), else on another host by shipping the snapshot (its bytes over the measured bandwidth from the
base host, paid once per host) or re-running the set-up there (the measured set-up time, once per host), or queued
on a host behind the rollouts already placed there (a rollout's expected duration per slot)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from ..._exceptions import HostError
from ._model import DEFAULT_BANDWIDTH, HostInfo

Placement = Literal["base", "shipped", "re-setup"]


class Plan(msgspec.Struct, frozen=True):
    """Rollout ``rollout`` runs on ``host`` by ``placement``; ``estimates``: ``"<host>:<placement>"`` -> the
    estimated start (s) of every option weighed."""

    rollout: int
    host: str
    placement: str
    estimates: dict[str, float]


class Ledger:
    """The slots one client has asked hosts for and not yet got: each reservation (``reserve``) names a claim that
    the client sends with its request, and counts on its host until the request ends (``release``) or the host's
    info lists the claim, the host counting the slot itself from then on (``HostInfo.claims``: waiting, then in
    use). So a workspace is counted once, by the client or by its host, never by both: a host's info that already
    holds a create whose reply has not yet reached the client does not make the client count it twice."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, int]] = {}  # claim -> (host name, slots)

    def reserve(self, host: str, k: int = 1) -> str:
        """Reserve ``k`` slots on ``host``; returns the claim to send with the request (and to ``release``)."""
        claim = secrets.token_hex(8)
        self._held[claim] = (host, k)
        return claim

    def release(self, claim: str) -> None:
        """The request of ``claim`` ended (answered or failed). Idempotent."""
        self._held.pop(claim, None)

    def pending(self, infos: Sequence[HostInfo | None]) -> dict[str, int]:
        """Slots reserved on each host (by name) that its info (from ``infos``) does not count yet."""
        seen = {i.name: set(i.claims) for i in infos if i is not None}
        out: dict[str, int] = {}
        for claim, (host, k) in self._held.items():
            if claim not in seen.get(host, ()):
                out[host] = out.get(host, 0) + k
        return out

    def __len__(self) -> int:
        return len(self._held)


def room(info: HostInfo, pending: Mapping[str, int]) -> int:
    """Free slots of a host: its limit less what it runs, what waits in its queue and what a client has placed
    there that the host does not count yet (``pending``, by host name); negative when over-committed."""
    return info.max_workspaces - info.in_use - info.waiting - pending.get(info.name, 0)


def roomiest(infos: Sequence[HostInfo | None], pending: Mapping[str, int]) -> int | None:
    """The index of the live host (not None) with the most ``room``, the first of equals; None when none lives."""
    best: tuple[int, int] | None = None
    for i, info in enumerate(infos):
        if info is not None:
            r = room(info, pending)
            if best is None or r > best[0]:
                best = (r, i)
    return None if best is None else best[1]


def plan_group(
    n: int,
    base: str,
    infos: Sequence[HostInfo],
    *,
    snapshot_bytes: int,
    setup_seconds: float,
    rollout_seconds: float,
    restore_seconds: float = 0.1,
    default_bandwidth: float = DEFAULT_BANDWIDTH,
    pending: Mapping[str, int] | None = None,
) -> list[Plan]:
    """Where each of a group's ``n`` rollouts goes (the cost model, see the module doc). A rollout's cost on a host
    is when it can start: the one-off cost of getting the snapshot there (nothing on the base host; on another, the
    cheaper of shipping, ``snapshot_bytes`` over the measured bandwidth from ``base``, and re-running the set-up,
    paid by the first rollout placed there), a restore, and the wait for a slot: ``rollout_seconds`` for each full
    round of the host's slots already taken (``pending``: workspaces placed on each host by other groups that the
    host does not count yet). Ties go to the base host, then to the option named first. ``HostError`` when
    ``infos`` (the live hosts) is empty."""
    if not infos:
        raise HostError("no live host to place the group on", host="*")
    pending = pending or {}
    free = {i.name: max(0, room(i, pending)) for i in infos}
    slots = {i.name: i.max_workspaces for i in infos}
    placed = {i.name: 0 for i in infos}
    how: dict[str, str] = {base: "base"}  # the hosts that have the snapshot, and how they got it
    out = []
    for r in range(n):
        est: dict[str, float] = {}
        for i in infos:
            h = i.name
            ahead = placed[h] - free[h]  # rollouts already placed there that will wait for a slot
            wait = 0.0 if ahead < 0 else rollout_seconds * (1 + ahead // slots[h])
            if h in how:
                est[f"{h}:{how[h]}"] = wait + restore_seconds
            else:
                bw = i.bandwidth.get(base, default_bandwidth)
                est[f"{h}:shipped"] = max(wait, snapshot_bytes / bw) + restore_seconds
                est[f"{h}:re-setup"] = max(wait, setup_seconds) + restore_seconds
        choice = min(est, key=lambda k: (est[k], k.split(":")[0] != base))
        h, placement = choice.split(":", 1)
        how[h] = placement
        placed[h] += 1
        out.append(Plan(r, h, placement, est))
    return out


def with_bandwidth(info: HostInfo, base: str, override: Mapping[str, float]) -> HostInfo:
    """``info`` with its bandwidth from ``base`` replaced by ``override[info.name]`` (bytes/s), if given."""
    if info.name not in override:
        return info
    return msgspec.structs.replace(info, bandwidth={**info.bandwidth, base: override[info.name]})


def mean_update(previous: float | None, sample: float, weight: float) -> float:
    """A running mean: ``sample`` with ``weight`` into ``previous`` (``sample`` itself when there is none)."""
    return sample if previous is None else (1 - weight) * previous + weight * sample
