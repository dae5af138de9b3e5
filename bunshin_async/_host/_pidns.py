"""The last pid a workspace's pid namespace handed out (``kernel.ns_last_pid``), kept with a dump so that a copy's
next process gets the pid its source's next process gets.

CRIU restores every task of a copy at its old pid with clone3's ``set_tid``, which allocates exactly that pid and
leaves the namespace's cursor behind (kernel/pid.c, ``alloc_pid``): without more, a copy's next process got the
lowest free pid, its source's the one after its last. A dump reads the value with the tree frozen (``LastPid``,
beside CRIU's dump, so that the pause does not grow) into ``LAST_PID_IMG`` among the images; the restore sets the
copy's namespace to it once its tasks are made (criu/patches/0021, which bounds what it reads: the images are
untrusted).

The sysctl answers for the pid namespace of the task that reads it, not for the procfs it is opened on, so the host
cannot read it from a path: ``bunshin-init --last-pid`` (native/init.c) joins the namespace through a pidfd and
reads it from a child made there at a pid asked for with ``set_tid`` (which leaves the cursor alone). A workspace
may set its own value, so what comes back is bounded here: anything but a pid in ``(0, pid_max)`` is nothing to
keep."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
from pathlib import Path

from . import _paths
from ._threads import join_thread

__all__ = ["LAST_PID_IMG", "LastPid", "parse_exchange", "parse_last_pid"]

log = logging.getLogger("bunshin_async.fork")

LAST_PID_IMG = "bunshin-last-pid"
"""The file among a dump's images that holds the value (text); criu/patches/0021 reads it at the restore."""
TIMEOUT = 60.0
"""Seconds the helper waits to be asked (a dump's freeze is bounded well below), and may take once asked."""
MAX_OUTPUT = 256
"""Bytes of the helper's answer looked at: ``L <pid>`` or ``E <step>: <error>``."""


def pid_max() -> int:
    """The host's ``kernel.pid_max``: no pid reaches it in any namespace of the host's (blocking)."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 1 << 22  # PID_MAX_LIMIT on 64-bit


def parse_last_pid(out: bytes, limit: int) -> int | None:
    """The pid in the helper's answer ``L <pid>``, if it is one in ``(0, limit)``; ``None`` for anything else (a
    namespace whose cursor was never moved reads -1; a value its workspace set is whatever the kernel allowed)."""
    head, _, rest = out[:MAX_OUTPUT].partition(b" ")
    text = rest.strip()
    if head != b"L" or not text.isdigit() or len(text) > 10:
        return None
    value = int(text)
    return value if 0 < value < limit else None


def parse_exchange(out: bytes, limit: int) -> tuple[int | None, bool]:
    """The answer of ``--last-pid FD EXPECT NEW``: the pid read (``parse_last_pid``), and whether the helper wrote
    NEW (``L <pid> W``: it read EXPECT)."""
    text = out[:MAX_OUTPUT].rstrip()
    written = text.endswith(b" W")
    return parse_last_pid(text[:-2] if written else text, limit), written


class LastPid:
    """The last pid of a workspace's namespace, read with the tree frozen into ``images / LAST_PID_IMG`` by
    ``bunshin-init --last-pid`` in a thread of its own: ``start`` (before the freeze) starts the helper, which joins
    the namespace and waits; ``ask`` (frozen: CRIU's query-ext-files) lets it read; ``finish`` (still frozen:
    post-dump) waits for the value; ``join`` (shielded; always) lets a helper never asked go and waits. Only the
    read itself (a clone and a pread, well under a millisecond) falls in the pause, beside CRIU's dump, as the upper
    dir's copy does (``_snapstore.TreeCopy``); the helper's exec came before. A value that cannot be had writes
    nothing (logged): the copy's pids then start where CRIU's restore leaves them."""

    def __init__(self, pid: int, images: Path) -> None:
        self.pid, self.images = pid, images
        self.value: int | None = None
        self._go = threading.Event()
        self._asked = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bunshin-last-pid", daemon=True)
            self._thread.start()

    def ask(self) -> None:
        self._asked = True
        self._go.set()

    async def finish(self) -> int | None:
        self.start()
        self.ask()
        await self.join()
        return self.value

    async def join(self) -> None:
        self._go.set()  # a helper never asked reads EOF and exits
        if self._thread is not None:  # asked at query-ext-files: at post-dump it has almost always answered
            await join_thread(self._thread)

    def _run(self) -> None:
        try:
            fd = os.pidfd_open(self.pid)
        except OSError as exc:
            log.warning("pid %d: its pid namespace's last pid: %s", self.pid, exc)
            return
        try:
            cmd = [str(_paths.init_binary()), "--last-pid", str(fd)]
            with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,)) as proc:
                assert proc.stdin is not None and proc.stdout is not None
                self._go.wait(TIMEOUT)
                out = b""
                try:
                    if self._asked:
                        # Unbuffered: a helper that ended before reading fails this write once, not again when
                        # Popen's exit closes stdin (a buffered byte is flushed there: "Broken pipe" twice), and
                        # its own answer below says why it ended.
                        with contextlib.suppress(BrokenPipeError):
                            os.write(proc.stdin.fileno(), b"g")
                    proc.stdin.close()  # EOF for a helper never asked
                    out = proc.stdout.read(MAX_OUTPUT)
                    proc.wait(TIMEOUT)
                except (OSError, subprocess.TimeoutExpired) as exc:
                    proc.kill()
                    log.warning("pid %d: its pid namespace's last pid: %s", self.pid, exc)
                    return
        except OSError as exc:
            log.warning("pid %d: its pid namespace's last pid: %s", self.pid, exc)
            return
        finally:
            os.close(fd)
        if not self._asked:
            return
        if proc.returncode != 0:
            why = out.decode(errors="replace").strip() or f"exit status {proc.returncode}"
            log.warning("pid %d: its pid namespace's last pid: %s", self.pid, why)
            return
        value = parse_last_pid(out, pid_max())
        if value is None:
            return
        try:
            (self.images / LAST_PID_IMG).write_text(f"{value}\n")  # our own directory in the store
        except OSError as exc:
            log.warning("pid %d: keeping its pid namespace's last pid: %s", self.pid, exc)
            return
        self.value = value
