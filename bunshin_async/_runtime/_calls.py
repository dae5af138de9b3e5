"""Canonical call identity and the interfaces the runtime speaks to predictors and policies.

The runtime only knows these Protocols; the predictors and policies themselves live in the ``speculator`` package
(which imports ``bunshin_async``, never the reverse).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import xxhash

from .._tools._tools import Effect, Tool

__all__ = [
    "CallKey",
    "Candidate",
    "Launch",
    "Policy",
    "PredictionContext",
    "Predictor",
    "canonical_args",
    "chain_root",
    "extend_chain",
]

_canon_encoder = msgspec.json.Encoder(order="deterministic")


def canonical_args(tool: Tool | None, args: Mapping[str, Any]) -> bytes:
    """The arguments as deterministic JSON, after the tool's own normalization (defaults filled in, ``1.0`` and
    ``1`` made one number), so two spellings of one call compare equal. Raises ``InvalidArgument``."""
    norm = tool.normalize(args) if tool is not None else dict(args)
    return _canon_encoder.encode(norm)


class CallKey(msgspec.Struct, frozen=True):
    """What makes two calls the same call: tool name, tool version and canonical arguments (JSON bytes)."""

    name: str
    version: str
    args: bytes

    @classmethod
    def of(cls, tool: Tool, args: Mapping[str, Any]) -> CallKey:
        return cls(tool.name, tool.version, canonical_args(tool, args))

    def arguments(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.json.decode(self.args)
        return out

    def digest(self) -> bytes:
        return xxhash.xxh3_128(_canon_encoder.encode((self.name, self.version, self.args))).digest()


def chain_root(salt: str = "") -> bytes:
    """Key of the empty call history (``salt`` separates tasks: rollouts of one group share it)."""
    return xxhash.xxh3_128(b"bunshin-chain\0" + salt.encode()).digest()


def extend_chain(key: bytes, call: CallKey) -> bytes:
    """Key of the history ``key`` followed by ``call`` (a prefix hash: equal histories give equal keys)."""
    h = xxhash.xxh3_128(key)
    h.update(call.digest())
    return h.digest()


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """A predicted next call. ``probability`` is the predictor's belief that the next call is exactly this one;
    ``expected_seconds`` (optional) the predictor's guess of its run time; ``source`` names the predictor."""

    name: str
    arguments: dict[str, Any]
    probability: float
    source: str = ""
    expected_seconds: float | None = None


class PredictionContext(msgspec.Struct, frozen=True, kw_only=True):
    """What a predictor may look at: the rollout's previous calls (oldest first, canonical), the chain key of that
    history (equal across rollouts of a group that made the same calls), the turn number, and ``position`` (the
    index in the current message of the call being predicted; the ``decided`` ones before it are known);
    ``last_output`` is what the rollout's latest finished call printed (stdout then stderr, or the tool error's
    message), the observation the model is reasoning about (argument filling: the module an import error names)."""

    history: tuple[CallKey, ...]
    chain: bytes
    turn: int
    position: int
    decided: tuple[CallKey, ...] = ()
    group: str = ""
    last_output: str = ""


@runtime_checkable
class Predictor(Protocol):
    """Ranks candidate next calls. ``predict`` must be cheap (it runs on the event loop, at every decision point);
    ``observe`` is told the call that was really made in ``ctx`` (to learn online)."""

    name: str

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]: ...

    def observe(self, ctx: PredictionContext, call: CallKey) -> None: ...


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """A candidate the runtime could launch, with what the runtime knows about it: its canonical ``key`` and its
    ``effect`` class for these arguments (``pure``/``read`` run in place, ``write`` in a fork) and
    ``turn_elapsed``, the seconds since the turn's model call started (what is left of the LLM's time bounds what
    a launch can hide). A chained launch (``depth`` > 0) would run after ``depth`` speculated calls not yet asked
    for, in a fork of the last one's branch: ``prior`` is the probability that those are right (the product of
    their candidates' probabilities), so the launch pays only with probability ``prior x candidate.probability``;
    ``parent`` is the launch of the branch it follows (a policy that calibrates its predictors recalibrates the
    chain's odds through it).
    ``rollout`` names the rollout it is for (stable over its turns), ``group`` its group (``Speculation.group``) and
    ``progress`` counts the calls that rollout has made: a policy shared by a group prefers its straggler (one
    shared by several groups, each group's)."""

    candidate: Candidate
    key: CallKey
    effect: Effect
    turn_elapsed: float = 0.0
    depth: int = 0
    prior: float = 1.0
    rollout: str = ""
    progress: int = 0
    parent: Launch | None = None
    group: str = ""

    @property
    def probability(self) -> float:
        """The probability that this launch is used: ``prior x candidate.probability``."""
        return self.prior * self.candidate.probability

    @property
    def needs_fork(self) -> bool:
        return self.effect is Effect.WRITE


@runtime_checkable
class Policy(Protocol):
    """Chooses which of ``options`` (best first, deduplicated, none already running) to launch now, given how many
    branches run (``running``) and how many of those hold a fork (``forks``). Told, to learn online, every tool run
    time and every fork's cost. A policy may also have ``observe_llm(seconds)``: the runtime then tells it each
    turn's LLM time (from the request to the message's end); ``release(launch, used)``: told when a branch it
    selected ends, and whether the main line used it, to track what is in flight and how its launches fare;
    ``rollout_done(rollout)``: that rollout ended; ``observe_prediction(source, probability, hit)``: when a call is
    decided, for each predictor (``source``) that guessed it, the guesses' summed probability and whether one of them
    was the call (to learn its precision); ``observe_rollout_memory(bytes)``: after a fork's cost, the rollout
    workspace's footprint at that moment (PSS, the page images it maps, its upper dir), to weigh what a fork holds
    against what the rollout does; ``observe_copy(copy_bytes, rollout_bytes, rollout)``: beside each fork before its
    call, what the fork holds and what its rollout (``Launch.rollout``) holds (a hit's copy replaces the rollout:
    their difference is what a hit leaves it); ``observe_miss(bytes)``: what a discarded fork held at its end, its
    call's memory included (without it, that goes to ``observe_fork``); ``observe_transient(bytes)``: beside each
    fork before its call, what its making held (its cgroup's peak then: the restore's CRIU and what it restored);
    ``observe_fork_call(key, seconds, bytes, byte_seconds)``: a call run in a fork, hit or miss, took ``seconds``
    (negative: cut short), raised the fork's cgroup ``bytes`` above its charge when it started (``call_peak``) and
    held ``byte_seconds`` above that charge over its run (``CallMeter``, sampled; -1: not measured; a hook without
    that argument, session 20's form, is told the first three) (instead of
    ``observe_tool``, which then tells main-line and in-place runs only); ``observe_cpu(key, cpu_seconds, seconds)``: a
    call run on the main line took ``cpu_seconds`` of CPU (its workspace's cgroup, where it has CPU accounting) in
    ``seconds``, to tell waiting from computing; ``active()``: asked before the predictors are, False when no launch
    could pay now (the predictors are then not asked at all); ``keeps(launch)``: asked when a turn ends for each
    unused branch it could hand to the next turn (``Speculation.keep``), False lets it go (keeping it would cost more
    than its expected use saves)."""

    def select(self, options: Sequence[Launch], *, running: int, forks: int) -> list[Launch]: ...

    def observe_tool(self, key: CallKey, seconds: float) -> None: ...

    def observe_fork(self, seconds: float, memory_bytes: int) -> None: ...
