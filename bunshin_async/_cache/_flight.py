"""Single flight: identical calls at the same state, issued concurrently by sibling rollouts, execute once.

The first caller of a key is the leader and runs the call; the others wait for it. When the leader publishes an
entry the waiters use it (a result, or a snapshot to restore); when it fails without one (a timeout, a
cancellation), the waiters go round again and one of them leads.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ._records import Entry


class Flight:
    __slots__ = ("done", "entry")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.entry: Entry | None = None


class SingleFlight:
    def __init__(self) -> None:
        self._flights: dict[bytes, Flight] = {}

    def get(self, key: bytes) -> Flight | None:
        return self._flights.get(key)

    def lead(self, key: bytes) -> Flight:
        assert key not in self._flights
        flight = self._flights[key] = Flight()
        return flight

    def finish(self, key: bytes, flight: Flight, entry: Entry | None) -> None:
        flight.entry = entry
        if self._flights.get(key) is flight:
            del self._flights[key]
        flight.done.set()

    def __len__(self) -> int:
        return len(self._flights)


class ReadFlight:
    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value: tuple[Any, Any, float] | None = None  # its leader's (outcome, token, seconds), once it ended


class SharedReads:
    """Speculative reads in flight (``CachedSession.share``), apart from the main line's ``SingleFlight``: a
    sibling's speculative run serves only speculative reads, so a main-line call still runs where the cached plain
    loop runs it, and nothing is stored until a rollout takes a result (``Calls.adopt``)."""

    def __init__(self) -> None:
        self._flights: dict[bytes, ReadFlight] = {}

    async def share(
        self,
        key: bytes,
        run: Callable[[], Awaitable[tuple[Any, Any]]],
        take: Callable[[Any], Awaitable[bool]],
    ) -> tuple[Any, float | None]:
        """The outcome of the read ``key``, and the seconds the leader's run took when it served this one (None:
        ``run`` ran here). ``run`` returns the outcome and a token (what a waiter must take on to be served it: the
        runtime's pid span); a waiter is served the leader's outcome if ``take(token)`` says yes, else runs its
        own. A leader that ended without an outcome (cancelled, failed) serves nobody: its waiters go round, one
        of them leading."""
        while (flight := self._flights.get(key)) is not None:
            await flight.done.wait()
            if flight.value is not None:
                outcome, token, seconds = flight.value
                if await take(token):
                    return outcome, seconds
                return (await run())[0], None
        flight = self._flights[key] = ReadFlight()
        try:
            t0 = time.perf_counter()
            outcome, token = await run()
            flight.value = (outcome, token, time.perf_counter() - t0)
        finally:
            del self._flights[key]
            flight.done.set()
        return outcome, None

    def __len__(self) -> int:
        return len(self._flights)
