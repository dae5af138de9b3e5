"""The pid cursor around speculative calls run in place (issue #38: the same results in every configuration).

A speculative read runs in the rollout's own workspace, not in a fork, and the processes it starts take pids from
the workspace's pid namespace whether the rollout uses the read or not. After an unused one the main line's next
`cmd & echo $!` printed another pid than the plain loop. A ``ReadPids`` scope (``PidLedger.read``) reads the
namespace's cursor (``kernel.ns_last_pid``, through ``bunshin-init --last-pid``: ``_pidns``) before the scope's
first request that may start a process and after the scope ends, and the ledger *settles* it before anything else
may take a pid (another such request, a dump's ``quiesce``, the next scope): unused (or not yet known to be used),
the cursor goes back to where the read found it; used (``ReadPids.use``), it stays or goes forward again.

Only a scope that provably took pids alone is put back: no other request that may start a process was in flight
when it began or started before it ended, the workspace's own processes (all but pid 1 and the agent) are the same
tasks with the same CPU time at its end as at its start (none ran, so none forked), and none of its own processes
is left. Each move is a compare-and-set in the namespace (the value the scope left, or put back): anything that took
a pid since fails it, and the cursor then stays where it is. So a read that ran beside another call, beside a busy
guest process (a server polling), or that left a process behind, moves the pids as before (docs/concepts/
speculation.md, Guarantees). A cursor set back never makes the kernel hand out a pid in use (``alloc_pid`` skips
them); it only makes the pids of processes that ended be handed out again, as the plain loop would have.

What crosses the boundary is bounded: the helper's answer (``parse_last_pid``) and the host's own /proc and cgroup
files (host pids, read on the host; nothing inside the workspace's tree is looked up).
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import logging
import os
import select
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio

from . import _paths
from . import _protocol as P
from ._pidns import MAX_OUTPUT, TIMEOUT, parse_exchange, pid_max

__all__ = ["PID_REQUESTS", "PidLedger", "ReadPids", "exchange_last_pid", "guest_tasks"]

log = logging.getLogger("bunshin_async.speculation")
_T = TypeVar("_T")

PID_REQUESTS = (P.Exec, P.ShellOpen, P.ShellRun, P.Spawn, P.Signal)
"""Requests that may start a process in the workspace (a signal may make one fork)."""
MAX_TASKS = 4096
"""Tasks of a workspace looked at; one with more is not quiet enough to be sure of."""


HELPER_FD = 3
"""The descriptor the helper gets the pidfd on (``posix_spawn`` dups it there; the host's own is close-on-exec)."""
LOW_FDS = 10
"""The pidfd is duplicated to this descriptor or above for the helper's file actions: with the host's 0 or 1 closed
(a daemon), a lower one could be one of them, and the dup2 onto 0 or 1 before it overwrote it. (The pipe ends are
safe: a pipe's read end takes the lower number, so the write end dup2'ed onto 1 is never 0.)"""


def exchange_last_pid(
    pid: int, pidfd: int, expect: int | None = None, new: int | None = None
) -> tuple[int | None, bool]:
    """The last pid of the pid namespace of the process ``pidfd`` refers to (its pid 1, host pid ``pid``: for the
    logs), and, given ``expect`` and ``new``, whether it was ``expect`` and set to ``new`` (``bunshin-init
    --last-pid``). ``pidfd`` is the caller's and stays open: a pid opened again by number may be another process's
    by now. ``(None, False)`` when it cannot be had (logged). Blocking: a helper process, ~1 ms. Spawned with
    ``posix_spawn``, not ``subprocess``: paired with ``Popen``, 1.05 against 1.1 ms quiet, 0.74-0.83 against
    1.1-1.7 ms with the machine loaded (p90 halved)."""
    limit = pid_max()
    args = ["bunshin-init", "--last-pid", str(HELPER_FD)]
    if expect is not None and new is not None:
        args += [str(expect), str(new)]
    out: bytes | None = b""
    child = 0
    fd = r_in = w_in = r_out = w_out = -1
    try:
        fd = fcntl.fcntl(pidfd, fcntl.F_DUPFD_CLOEXEC, LOW_FDS)  # the child's HELPER_FD, dup2'ed from
        r_in, w_in = os.pipe()  # close-on-exec: the child gets only what the file actions dup (dup2 clears it)
        r_out, w_out = os.pipe()
        dup = os.POSIX_SPAWN_DUP2
        actions = [(dup, r_in, 0), (dup, w_out, 1), (dup, fd, HELPER_FD)]
        child = os.posix_spawn(str(_paths.init_binary()), args, {}, file_actions=actions)
        os.close(w_out)
        w_out = -1
        os.write(w_in, b"g")  # it reads one byte and answers (it may have failed and gone first: EPIPE)
        out = _read_answer(r_out)
    except OSError as exc:
        log.warning("pid %d: its pid namespace's last pid: %s", pid, exc)
    finally:
        for f in (fd, r_in, w_in, r_out, w_out):
            if f >= 0:
                os.close(f)
        status = _reap(child, kill=out is None) if child else -1
    if out is None:
        log.warning("pid %d: its pid namespace's last pid: no answer in %s s", pid, TIMEOUT)
        return None, False
    if status != 0:
        if out:
            log.warning("pid %d: its pid namespace's last pid: %s", pid, out[:MAX_OUTPUT].decode(errors="replace"))
        return None, False
    return parse_exchange(out, limit)


def _read_answer(fd: int) -> bytes | None:
    """What the helper printed until it closed its end (at most ``MAX_OUTPUT`` bytes kept), None after ``TIMEOUT``.
    ``poll``, not ``select``: a host with many workspaces holds descriptors past FD_SETSIZE."""
    out = b""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + TIMEOUT
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return out
        out = (out + chunk)[: MAX_OUTPUT * 2]


def _reap(child: int, *, kill: bool) -> int:
    """Wait for the helper, killed first when it did not answer in time; its exit status."""
    try:
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        _, status = os.waitpid(child, 0)
        return os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        return -1


def _runtime(path: str) -> int:
    """The first field of a task's schedstat (nanoseconds it ran), -1 if it cannot be read (a zombie's)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64).split(b" ", 1)[0]
        return int(head) if head.isdigit() and len(head) <= 20 else -1
    except OSError:
        return -1


def _ns_pid(pid: int) -> int | None:
    """``pid``'s pid in its innermost pid namespace (the last of /proc/<pid>/status's NSpid)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(8192).splitlines():
                if line.startswith(b"NSpid:"):
                    last = line.split()[-1]
                    return int(last) if last.isdigit() and len(last) <= 10 else None
    except OSError:
        pass
    return None


def guest_tasks(procs: str, pid1: int) -> dict[int, int] | None:
    """The workspace's own tasks (host tids of every thread in its cgroup ``procs`` file, and pid 1's children,
    zombies included) but pid 1 and the agent (its pids 1 and 2), each with the nanoseconds it ran; None when that
    cannot be known. Two equal readings mean none of them ran in between, so none made a process. Blocking: the
    host's /proc and cgroup files only."""
    bound = MAX_TASKS * 12  # a list longer than this holds more than MAX_TASKS pids: not read further
    try:
        with open(procs, "rb") as f:
            listed = f.read(bound + 1)
        with open(f"/proc/{pid1}/task/{pid1}/children", "rb") as f:
            children = f.read(bound + 1)
    except OSError:
        return None
    if len(listed) > bound or len(children) > bound:
        return None
    pids = {p.decode() for p in (*listed.split(), *children.split())}
    if len(pids) > MAX_TASKS:
        return None
    tasks: dict[int, int] = {}
    for p in pids:
        if not p.isdigit() or int(p) == pid1:
            continue
        ns = _ns_pid(int(p))
        if ns == 2:  # the agent: its threads serve the host's requests, counted there
            continue
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            tids = []
        if not tids:  # gone since: it ran
            tasks[int(p)] = -1
        for t in tids[:MAX_TASKS]:
            if t.isdigit():
                tasks[int(t)] = _runtime(f"/proc/{p}/task/{t}/schedstat")
    return tasks


_current: contextvars.ContextVar[ReadPids | None] = contextvars.ContextVar("bunshin_read_pids", default=None)


class ReadPids:
    """One speculative call run in place and what its processes did to the pid cursor. The runtime calls ``use``
    once the rollout takes its result (before anything else may run), ``drop`` once it never will."""

    def __init__(self, ledger: PidLedger) -> None:
        self.ledger = ledger
        self.state = "running"  # -> "ran" (it took pids alone), "back" (put back), "done" (nothing more to do)
        self.before: int | None = None  # the cursor when it first asked for a process
        self.after: int | None = None  # and when it ended
        self.started = 0  # the ledger's count of requests that may start a process, when it first asked
        self.own = 0  # such requests it made
        self.alone = False  # nothing else that may start a process was in flight then
        self.tasks: dict[int, int] | None = None
        self.used = False
        self.decided = False
        self.dropped = False
        self.span: tuple[int, int] | None = None  # (before, after) once it provably took pids alone

    def use(self, *, ran: bool = True) -> None:
        """The rollout takes its result. ``ran``: the plain loop would have run the call here; False when it
        would have been served without running (a tool cache's hit): its pids then go back as an unused read's."""
        self.used, self.decided = ran, True

    def drop(self) -> None:
        self.dropped = True


class PidLedger:
    """An agent client's count of the requests that may start a process, and the in-place scopes to settle. ``pid1``
    is the workspace's pid 1 (host pid) and ``pidfd`` its pidfd, borrowed from the client (``close`` lets go of it),
    ``procs`` a callable giving its cgroup's procs file (None: no scope is ever put back)."""

    def __init__(self, pid1: int, pidfd: int, procs: Callable[[], str | None] | None = None) -> None:
        self.pid1, self.pidfd, self.procs = pid1, pidfd, procs
        self.started = 0
        self.busy = 0
        self.active = 0  # scopes whose call runs (a dump waits for them: ``AgentClient.quiesce``)
        self.ended = anyio.Event()  # set when a scope ends
        self.closed: list[ReadPids] = []  # scopes whose call returned, not yet measured
        self.reads: list[ReadPids] = []  # measured, to settle
        self.settled = 0  # put back (counters for tests and logs)
        self.forward = 0
        self.marked: int | None = None  # the cursor when a captured call began (``mark``)
        self._lock = anyio.Lock()
        self._idle = anyio.Event()  # set when no request that may start a process is in flight

    @staticmethod
    def current() -> ReadPids | None:
        return _current.get()

    def rebind(self, pid1: int, pidfd: int) -> None:
        """A new pid 1 (a restore in place): its cursor came with its images; nothing is left to settle."""
        self.pid1, self.pidfd = pid1, pidfd
        self.marked = None
        for r in self.reads:
            r.state = "done"
        self.reads = []

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[ReadPids]:
        """The scope of one speculative call run in place (module doc): its requests are its own (a context
        variable), and its end reads the cursor again, shielded."""
        r = ReadPids(self)
        self.active += 1
        token = _current.set(r)
        try:
            yield r
        finally:
            # Before any await: once its call returned, the next request of another task finds it closed and
            # measures it first (``_settle``), whichever task runs first.
            _current.reset(token)
            self.closed.append(r)
            try:
                with anyio.CancelScope(shield=True), anyio.move_on_after(TIMEOUT):
                    async with self._lock:
                        await self._measure()
            finally:
                if r.state == "running":
                    r.state = "done"
                if r in self.closed:
                    self.closed.remove(r)
                self.active -= 1
                self.ended.set()
                self.ended = anyio.Event()

    async def before(self, req: P.Request) -> ReadPids | None:
        """Called by the client before sending ``req``: settle what other scopes left, or, for a scope's first
        request that may start a process, wait until no other such request is in flight and read the cursor.
        Returns the scope ``req`` counts for."""
        if not isinstance(req, PID_REQUESTS):
            return None
        r = _current.get()
        if r is not None and r.ledger is not self:
            r = None
        if not (self.closed or self.reads or self._lock.locked() or (r is not None and r.own == 0)):
            self.started += 1  # nothing to settle or read: no await (the exec round trip's hot path)
            self.busy += 1
            if r is not None:
                r.own += 1
            return r
        first = r is not None and r.own == 0
        if first:  # a scope starts after what runs (the plain loop's order), not beside it
            await self._until_idle()
        async with self._lock:
            if first:
                await self._measure()  # the reads before it stay until the rollout takes or leaves them
            else:
                await self._settle()
            if r is not None and r.own == 0 and r.state == "running":
                r.alone, r.started = self.busy == 0, self.started
                procs = self.procs() if self.procs is not None else None
                if r.alone and procs is not None:
                    r.before, r.tasks = await self._reading(procs)
            self.started += 1
            self.busy += 1
            if r is not None:
                r.own += 1
        return r

    async def _until_idle(self) -> None:
        """Until no request that may start a process is in flight."""
        while self.busy:
            if self._idle.is_set():  # one event for every waiter: a new one per waiter would strand the others
                self._idle = anyio.Event()
            await self._idle.wait()

    async def adopt(self, before: int, after: int) -> ReadPids | None:
        """A read a sibling's workspace ran for this one (the tool cache's single flight), whose processes took the
        pids after ``before`` up to ``after`` there (its ``ReadPids.span``): if this cursor stands at ``before``,
        those are the pids its processes would have taken here, so the cursor moves to ``after`` (compare-and-set)
        and the returned scope is settled as a read of this workspace that ran alone (put back unless used). None
        where the cursor is elsewhere, or something else may take a pid meanwhile (a request in flight, a scope
        running): the read must then run here to print this workspace's own pids. Waits, as a scope's first
        request does, until no request that may start a process is in flight."""
        await self._until_idle()
        async with self._lock:
            await self._measure()
            if self.busy or self.active or self.procs is None or not before <= after:
                return None
            if not await self._exchange(before, after):
                return None
            r = ReadPids(self)
            r.state, r.alone, r.before, r.after, r.span = "ran", True, before, after, (before, after)
            self.reads.append(r)
            return r

    async def cursor(self) -> int | None:
        """Where this workspace's own next process starts: the namespace's last pid once no request that may start
        a process is in flight and what in-place scopes left is settled (put back unless used). None when it
        cannot be read."""
        await self._until_idle()
        async with self._lock:
            await self._settle()
            pid1 = self.pid1
            return await self._on_pidfd(lambda fd: exchange_last_pid(pid1, fd)[0], None)

    async def mark(self) -> None:
        """A call whose pids a capture records is about to run here (a tool cache's write, a write branch's fork):
        remember the cursor, for ``since_mark``."""
        self.marked = await self.cursor()

    async def since_mark(self) -> int | None:
        """How far the cursor moved since ``mark`` (the pids the call took, as the workspace's own sequence goes),
        None if not marked or not known. Forgets the mark."""
        marked, self.marked = self.marked, None
        now = await self.cursor() if marked is not None else None
        return now - marked if now is not None and marked is not None and now >= marked else None

    async def continue_at(self, last: int) -> bool:
        """Set the cursor to ``last`` (compare-and-set against the value just read): a workspace restored from a
        sibling's snapshot continues the restoring rollout's own pid sequence, not the sibling's. A pid in use is
        never handed out again whatever the cursor says (``alloc_pid`` skips it)."""
        async with self._lock:
            await self._settle()
            pid1 = self.pid1
            now = await self._on_pidfd(lambda fd: exchange_last_pid(pid1, fd)[0], None)
            if now is None or last < 0:  # the helper bounds it by pid_max
                return False
            return now == last or await self._exchange(now, last)

    def after(self, req: P.Request) -> None:
        if isinstance(req, PID_REQUESTS):
            self.busy -= 1
            if not self.busy:
                self._idle.set()

    async def settle(self) -> None:
        async with self._lock:
            await self._settle()

    def close(self) -> None:
        """The client closes, or its pid 1 is killed for another (before the core closes the pidfd): nothing is read or
        put back from now on (until ``rebind``)."""
        self.pidfd = -1

    async def _reading(self, procs: str, end: bool = False) -> tuple[int | None, dict[int, int] | None]:
        """The cursor and the guest's tasks: at a scope's start the tasks first, at its end the cursor first, so
        that a process of the workspace forking between the two readings shows in its CPU time either way."""
        pid1 = self.pid1

        def read(fd: int) -> tuple[int | None, dict[int, int] | None]:
            if end:
                value, _ = exchange_last_pid(pid1, fd)
                return value, guest_tasks(procs, pid1)
            tasks = guest_tasks(procs, pid1)
            return exchange_last_pid(pid1, fd)[0], tasks

        return await self._on_pidfd(read, (None, None))

    async def _exchange(self, expect: int, new: int) -> bool:
        pid1 = self.pid1
        return await self._on_pidfd(lambda fd: exchange_last_pid(pid1, fd, expect, new)[1], False)

    async def _on_pidfd(self, fn: Callable[[int], _T], closed: _T) -> _T:
        """``fn`` on a duplicate of pid 1's pidfd, in a worker thread: the duplicate is made here, on the event loop,
        while the client holds the pidfd (``close`` comes first), so the thread never meets a descriptor number
        closed and reused meanwhile. ``closed`` once closed."""
        if self.pidfd < 0:
            return closed
        fd = os.dup(self.pidfd)
        try:
            return await anyio.to_thread.run_sync(fn, fd)  # not abandoned when cancelled: fd is closed after it
        finally:
            os.close(fd)

    async def _measure(self) -> None:
        """The scopes whose call returned: each "ran" alone if nothing else may have taken a pid meanwhile (module
        doc), else there is nothing to do for it. With the lock held."""
        while self.closed:
            r = self.closed.pop(0)
            procs = self.procs() if self.procs is not None else None
            if r.state != "running" or r.own == 0 or not r.alone or r.before is None or procs is None:
                r.state = "done"
                continue
            r.state = "done"
            if self.started - r.started != r.own or self.busy:
                continue  # another request that may start a process ran beside it
            r.after, tasks = await self._reading(procs, True)
            if tasks is None or tasks != r.tasks or r.after is None or not r.before <= r.after:
                continue  # a process of the workspace ran, or one of the read's is left
            r.state, r.span = "ran", (r.before, r.after)
            self.reads.append(r)

    async def _settle(self) -> None:
        """Put back the cursor of every scope that ran and is not used, forward again that of one put back and used
        since (compare-and-set, in the order they ran). With the lock held."""
        await self._measure()
        for r in reversed(self.reads):  # the last first: each put back to where the one before it left the cursor
            assert r.before is not None and r.after is not None
            if r.state == "ran" and not r.used:
                moved = await self._exchange(r.after, r.before)
                r.state = "back" if moved else "done"
                self.settled += moved
        for r in self.reads:
            assert r.before is not None and r.after is not None
            if r.state == "back" and r.used:
                moved = await self._exchange(r.before, r.after)
                r.state = "done"
                self.forward += moved
            elif r.used or r.dropped:
                r.state = "done"
        self.reads = [r for r in self.reads if r.state != "done"]
