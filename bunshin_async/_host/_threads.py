"""Joining a host thread from the event loop."""

from __future__ import annotations

import threading

import anyio


async def join_thread(thread: threading.Thread) -> None:
    """Join ``thread``: in place when it has ended (the usual case at a dump's post-dump, with the tree frozen: a
    worker thread round trip costs the pause 0.1-0.4 ms on a busy 2-core host), else in a worker, shielded, so
    that the loop is never blocked and a cancellation does not leave the thread unjoined."""
    if not thread.is_alive():
        thread.join()
        return
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(thread.join)
