"""Single flight: identical calls at the same state, issued concurrently by sibling rollouts, execute once.

The first caller of a key is the leader and runs the call; the others wait for it. When the leader publishes an
entry the waiters use it (a result, or a snapshot to restore); when it fails without one (a timeout, a
cancellation), the waiters go round again and one of them leads.
"""

from __future__ import annotations

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
