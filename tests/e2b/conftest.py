"""The E2B server for the SDK tests: run in a thread with its own event loop, so that the synchronous SDK (which
blocks its caller) and the asynchronous one (on the test's loop) both reach it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import anyio
import anyio.from_thread
import pytest

from bunshin_async.integrations.e2b import E2BServer


@dataclass
class Served:
    server: E2BServer
    portal: anyio.from_thread.BlockingPortal

    @property
    def opts(self) -> dict[str, str]:
        """The SDK's connection options for this server (what E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY say)."""
        return {"api_url": self.server.url, "sandbox_url": self.server.url, "api_key": self.server.api_key}


@pytest.fixture
def e2b_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """A server on an ephemeral loopback port; the SDK's environment points at it for the test's duration."""
    with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(E2BServer()) as server:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("E2B_DOMAIN", "bunshin.localhost")
        yield Served(server, portal)
