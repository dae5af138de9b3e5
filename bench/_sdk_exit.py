"""The end of a process that used the ``e2b`` SDK, without CPython 3.11's abort at exit (gh-87135).

e2b's HTTP client (pyqwest: Rust, tokio) hands each response to asyncio from a tokio thread
(``loop.call_soon_threadsafe``), and the thread that woke the loop with the last response can still be inside the
self-pipe send when the process reaches ``Py_FinalizeEx``. CPython before 3.14 then ends that thread with
``pthread_exit``, whose forced unwind cannot cross its Rust frames: glibc aborts (SIGABRT after the process did its
work; same family as curioswitch/pyqwest#164). Seen about 1 run in 4 of tests/e2b/verifiers_client under load.

Dependency-free and imported by path (``bench/``'s scripts have it beside them; tests/e2b/verifiers_client runs in
another venv), so that every such client ends the same way."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_without_finalizing(code: int = 0) -> NoReturn:
    """Run the exit handlers (a library's backstops, e.g. verifiers' sandbox kill), flush stdout and stderr, and end
    the process with ``os._exit(code)``: no interpreter finalization for a tokio thread to be caught in."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
