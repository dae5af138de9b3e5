"""What a policy is told of a call that ran, by where it ran: one function that the runtime's main line and branches
and the offline replay (``speculator._replay``) all call, so the replay cannot tell the policy what the runtime does
not. Session 21's replay told every call's recorded seconds as a main-line run; the runtime tells a call the tool
cache served the seconds of its restore (or of its wait for an identical call in flight), and a fork's call, hit or
miss, only ``observe_fork_call``: a signature run only in forks stays "never run on the main line" for the launch
rule's call term."""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from typing import Any

from ._calls import CallKey, Policy

__all__ = ["Ran", "positional", "tell_run"]


class Ran(enum.Enum):
    """Where a call ran: ``MAIN``, decided and run on the main line (or served there by a tool cache: the seconds
    are its restore's, or its wait for an identical call in flight); ``IN_PLACE``, a branch's read in the rollout's
    workspace, hit or miss; ``FORK``, a branch's call in its fork, hit or miss."""

    MAIN = "main"
    IN_PLACE = "in place"
    FORK = "fork"


def tell_run(
    policy: Policy,
    key: CallKey,
    seconds: float,
    ran: Ran,
    *,
    cpu_seconds: float = -1.0,
    memory: Callable[[], tuple[int, float]] | None = None,
) -> None:
    """Tell ``policy`` that ``key`` ran ``seconds`` (negative: cut short, its run time unknown) where ``ran`` says.

    A fork's call goes to ``observe_fork_call(key, seconds, bytes, byte_seconds)`` where the policy has it, with
    what ``memory()`` measures (called only then: the bytes it raised its fork's cgroup by, the byte-seconds it held;
    a hook of session 20's form is told the first three); otherwise, and for any other run that ended, to
    ``observe_tool``. A main-line run's CPU seconds (``cpu_seconds``, negative: not read) go to ``observe_cpu``."""
    if ran is Ran.FORK:
        observe = getattr(policy, "observe_fork_call", None)
        if observe is not None:
            held, byte_seconds = memory() if memory is not None else (0, -1.0)
            told = (key, seconds, held, byte_seconds)
            observe(*told[: positional(observe, len(told))])
            return
    if seconds < 0:
        return
    policy.observe_tool(key, seconds)
    observe_cpu = getattr(policy, "observe_cpu", None) if ran is Ran.MAIN and cpu_seconds >= 0 else None
    if observe_cpu is not None:
        observe_cpu(key, cpu_seconds, seconds)


def positional(fn: Callable[..., Any], most: int) -> int:
    """How many positional arguments ``fn`` takes, up to ``most`` (``most`` when it takes ``*args`` or cannot be
    inspected)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return most
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return most
    return min(most, sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params))
