"""Ray behind one small interface: the only module of the integration that imports ``ray``. Calls to a host actor,
the streams it exports, and Ray's errors as the caller sees them: the ``BunshinError`` the host raised,
``HostCallError`` for another error raised in a host that is alive (that call failed, its workspaces stay), or
``HostError`` naming a host that died or cannot be reached."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio

from ..._exceptions import BunshinError, HostCallError, HostError
from .._require import require
from ._model import NAMESPACE, HostConfig, host_actor_name

require("ray", framework="Ray", extra="ray")  # a missing extra is CapabilityMissing naming it, not an ImportError

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

FRAMES_IN_FLIGHT = 4
"""Transfer frames a stream may have in Ray's object store at once (back-pressure on the exporting host)."""


def unwrap(exc: BaseException, host: str) -> BaseException:
    """A Ray error as what the caller should see: the ``BunshinError`` inside; ``HostCallError`` when the host's
    method raised something else (the host is alive: Ray reports a dead one as ``RayActorError``); ``HostError``
    when the host died or cannot be reached."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BunshinError):
        return cause
    if isinstance(exc, ray.exceptions.RayTaskError):
        error = type(cause).__name__ if cause is not None else "RayTaskError"
        return HostCallError(f"{error} in host {host}: {cause if cause is not None else exc}", host=host, error=error)
    if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError):
        return HostError(f"host {host} died or is unreachable: {type(exc).__name__}", host=host)
    if isinstance(exc, ray.exceptions.RayError):
        return HostError(f"host {host} failed: {exc}", host=host)
    return exc


ABANDON_SECONDS = 30.0
"""How long a cancelled call that made something waits for its reply, to release what the host made."""


async def _reply(ref: Any) -> Any:
    return await ref


async def call(
    actor: Any, method: str, *args: Any, host: str, abandoned: Callable[[Any], Awaitable[None]] | None = None
) -> Any:
    """``actor.method(*args)`` awaited; cancelled with the caller (the call is cancelled in Ray too). A call that
    makes something (``abandoned`` given) may be cancelled after the host made it and before its reply came: the
    reply is then still awaited, shielded (``ABANDON_SECONDS``), and handed to ``abandoned`` to release it, so
    that nothing stays held under the caller's owner until it stops."""
    ref = getattr(actor, method).remote(*args)
    try:
        return await _reply(ref)
    except ray.exceptions.RayError as exc:
        raise unwrap(exc, host) from exc
    except BaseException:
        ray.cancel(ref)  # a task the host still runs stops there; a finished one has its reply in the ref
        if abandoned is not None:
            with anyio.move_on_after(ABANDON_SECONDS, shield=True):
                try:
                    reply = await _reply(ref)
                except ray.exceptions.RayError:
                    pass  # cancelled in the host (it made nothing) or the host died (it freed what it made)
                else:
                    await abandoned(reply)
        raise


async def pull(actor: Any, source: str, snap_id: str) -> AsyncIterator[bytes]:
    """The transfer frames of snapshot ``snap_id`` that host ``source`` (``actor``) exports: a Ray streaming
    generator with back-pressure (``FRAMES_IN_FLIGHT``)."""
    gen = actor.export.options(num_returns="streaming", _generator_backpressure_num_objects=FRAMES_IN_FLIGHT).remote(
        snap_id
    )
    try:
        async for ref in gen:
            yield await ref
    except ray.exceptions.RayError as exc:
        raise unwrap(exc, source) from exc


def node_id() -> str:
    """The Ray node this process runs on."""
    return str(ray.get_runtime_context().get_node_id())


def lookup(name: str) -> Any:
    """The actor of host ``name`` (started by another driver); ``ValueError`` (Ray's) when there is none."""
    return ray.get_actor(host_actor_name(name), namespace=NAMESPACE)


@functools.cache
def _actor_class(cls: type) -> Any:
    return ray.remote(cls)


def start(cls: type, name: str, node_id: str, config: HostConfig, options: Any = None) -> Any:
    """A ``cls(name, config)`` actor pinned to Ray node ``node_id``, named ``host_actor_name(name)`` in
    ``NAMESPACE``, owned by this process (it stops when the process does); ``ValueError`` when the name is taken
    (a killed host's name is free once Ray has seen it die)."""
    return (
        _actor_class(cls)
        .options(
            name=host_actor_name(name),
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            **(options or {}),
        )
        .remote(name, config)
    )


def renew(actors: Sequence[Any], owner: str, timeout: float) -> None:
    """Renew ``owner``'s lease on every host (blocking, from the lease thread); a dead host is skipped: it holds
    nothing of the owner's any more."""
    refs = [a.renew.remote(owner) for a in actors]
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout)
        except ray.exceptions.RayError:
            pass
