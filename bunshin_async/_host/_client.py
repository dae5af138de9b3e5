"""The host end of the agent protocol: one Unix-socket connection per request in flight, pooled when idle.

A request cancelled mid-flight hangs up (shuts its side down); the agent sees the hang-up, kills the command it was
running, waits until it is reaped and closes its end, which the request waits for (shielded, ``HANG_UP_GRACE`` at
most): a cancelled call returns once its processes are gone, not while they are still exiting. A workspace about to
be destroyed (``abandon``) skips that wait: its close kills everything anyway.

Reaching the socket: the agent listens on ``/run/bunshin/agent.sock`` inside the workspace, and the host never
looks that name up itself. ``connect("/proc/<pid>/root/run/bunshin/agent.sock")`` would follow the workspace's
absolute symlinks against the *host's* root (``agent.sock -> /run/docker.sock`` would make the host, as root,
connect to Docker). Each new connection instead opens pid 1's root (``/proc/<pid>/root``, ``O_PATH``; the pidfd
then shows the pid still names our pid 1), looks the socket up below it with ``openat2(RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`` and ``O_PATH | O_NOFOLLOW``, checks that what it found is a socket
(``fstat``) and connects to ``/proc/self/fd/<n>``: connect(2) follows that magic link to the inode it holds
(``unix_find_bsd``), so no name inside the workspace is resolved by the host. The root is opened per connection,
not kept: a held reference to a workspace's root keeps its overlay mounted after pid 1 is gone (overlayfs then
finds the upper and work dirs in use). No connection stays open across a dump (``quiesce``), so CRIU never meets
one, and a restored copy, a rollback or a warm spare reaches its own agent through its own pid 1.

Whatever answers on the socket is untrusted: every answer is bounded by what its request can legitimately return
(``answer_limit``), a frame begun must keep arriving (``stall_timeout``), and a frame over its bound, one that
stalls, or a body that is not the answer the request expects is an ``AgentError`` that closes that connection
(the workspace stays usable through its others). A hang-up is a ``WorkspaceClosed``.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import struct
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from anyio.abc import SocketStream

from .._exceptions import AgentError, WorkspaceClosed
from . import _protocol as P
from ._pidcursor import PidLedger, ReadPids

_T = TypeVar("_T")

__all__ = ["AGENT_THREADS", "MIN_RATE", "SOCKET", "STALL_TIMEOUT", "AgentClient", "agent_threads", "answer_limit"]

SOCKET = "run/bunshin/agent.sock"
"""The agent's socket, below the workspace's root (agent.c SOCKET_PATH)."""
STALL_TIMEOUT = 10.0
"""Seconds a frame that has begun may pause before the rest arrives (the agent cuts a stalled request as soon)."""
MIN_RATE = 1 << 20
"""Bytes per second an answer must arrive at, on average, once it has begun (the agent writes as fast as the host
reads: a 512 MiB read gets over 8 minutes)."""
CONTROL_FRAME = 64 << 10
"""Bound of an answer without payload (``Pong``, ``Ok``, ``Spawned``, ...) and of a ``Failure``'s own fields: the
agent's messages are under 1 KiB; the path a failure echoes is counted with the request (``answer_limit``)."""
FILE_DATA_MAX = 512 << 20
"""Largest ``read_file`` answer without ``max_bytes`` (agent.c MAX_FILE_DATA)."""
LISTING_MAX = 64 << 20
"""Largest ``list_dir`` answer (agent.c MAX_LISTING); a larger directory is refused by the agent."""
UTF8_GROWTH = 3
"""Output is sent as UTF-8 with replacement: each byte that is not UTF-8 becomes U+FFFD, three bytes."""

HANG_UP_GRACE = 5.0
"""Seconds a cancelled request waits for the agent to end what it started and close its end: it kills the command's
process group and waits up to 1 s until pid 1 has reaped it (agent.c ``wait_group_gone``; a shell session's command
up to 2 s). Only an agent that does not answer a hang-up (a hostile workspace) makes a cancellation wait this long."""

AGENT_THREADS = 6
"""Connection threads the agent makes at start-up (agent.c DEFAULT_THREADS), before any workspace process, so that
serving a connection takes no pid from the workspace's sequence. A connection stays with its thread while it is
open, idle ones included, so the agent needs as many as the client's peak of calls at once since the last dump: the
main line's call (one tool call per step in the traces), the speculative reads run in place beside it (at most 4:
``speculator``'s ``max_branches``), and one more. Each thread costs every dump of the workspace (CRIU seizes and
dumps it: ~0.5-0.9 ms of pause each on the loaded 2-core machine, ``bench/agent_threads.py``), hence no more. A
connection beyond them gets a thread of its own, which moves the sequence by one (docs/concepts/workspace.md)."""
PIDS_PER_THREAD = 16
"""The pool takes at most one in this many of the workspace's pids limit (at least one thread)."""

_header = struct.Struct(">I")
_EXPECTED: dict[type[P.Request], type[P.Response]] = {
    P.Ping: P.Pong,
    P.Exec: P.ExecResult,
    P.ShellOpen: P.ShellOpened,
    P.ShellRun: P.ExecResult,
    P.ShellClose: P.Ok,
    P.ReadFile: P.FileData,
    P.WriteFile: P.Ok,
    P.ListDir: P.DirListing,
    P.Remove: P.Ok,
    P.Spawn: P.Spawned,
    P.Signal: P.Ok,
    P.Poll: P.PollResult,
}
_KINDS = {
    stat.S_IFLNK: "a symlink",
    stat.S_IFREG: "a regular file",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a fifo",
}


def answer_limit(req: P.Request, request_bytes: int) -> int:
    """The largest answer ``req`` (``request_bytes`` long, without its bulk data) can legitimately get, in bytes.

    A ``Failure`` may echo one of the request's strings (a path, a cwd) and carry a timed-out command's output, so
    every bound includes the request's own size and ``CONTROL_FRAME``."""
    limit = CONTROL_FRAME + request_bytes
    if isinstance(req, P.Exec | P.ShellRun):
        return limit + 2 * UTF8_GROWTH * max(req.max_output, 0)  # stdout and stderr
    if isinstance(req, P.ReadFile):
        wanted = FILE_DATA_MAX if req.max_bytes is None else min(max(req.max_bytes, 0), FILE_DATA_MAX)
        return limit + wanted
    if isinstance(req, P.ListDir):
        return limit + LISTING_MAX
    return limit


async def _hang_up(conn: SocketStream) -> bool:
    """Tell the agent the request is cancelled (a shutdown of our side: it reads end-of-file) and wait until it has
    ended the command and closed its end, dropping whatever it still sends (``HANG_UP_GRACE`` at most). Whether
    its end-of-file came: every descriptor of its end is closed."""
    with anyio.move_on_after(HANG_UP_GRACE):
        try:
            await conn.send_eof()
            while True:
                await conn.receive()
        except anyio.EndOfStream:
            return True
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
    return False


async def _hang_up_all(conns: list[SocketStream]) -> int:
    """``_hang_up`` of every connection at once (in turn, a quiesce waited for each agent's end-of-file before it
    sent the next: up to ``HANG_UP_GRACE`` each); how many closed without the agent's end-of-file."""
    if len(conns) == 1:  # the usual case (one idle connection), without a task group in the snapshot's pause
        return 0 if await _hang_up(conns[0]) else 1
    unseen = 0

    async def one(conn: SocketStream) -> None:
        nonlocal unseen
        unseen += not await _hang_up(conn)

    async with anyio.create_task_group() as tg:
        for conn in conns:
            tg.start_soon(one, conn)
    return unseen


def agent_threads(pids_limit: int | None) -> int:
    """The agent's pool for a workspace with ``pids_limit`` (``Limits.pids``; its threads count in it): a small
    limit gets a small pool, so that the workspace keeps its pids for its own processes."""
    if pids_limit is None:
        return AGENT_THREADS
    return max(1, min(AGENT_THREADS, pids_limit // PIDS_PER_THREAD))


def _bulk(req: P.Request) -> int:
    """Bytes of ``req`` that no answer echoes (a write's data, a command's stdin)."""
    if isinstance(req, P.WriteFile):
        return len(req.data)
    if isinstance(req, P.Exec) and req.stdin is not None:
        return len(req.stdin)
    return 0


class AgentClient:
    """Connections to the agent of the workspace whose pid 1 is ``pid`` (host pid). ``pidfd`` is that pid 1's
    pidfd, borrowed: its owner (the workspace core) closes the client before it closes the pidfd (or, keeping the
    client for the next pid 1, closes its ledger, ``pids.close``, until ``rebind``)."""

    def __init__(
        self,
        pid: int,
        pidfd: int,
        workspace_id: str,
        *,
        stall_timeout: float = STALL_TIMEOUT,
        procs: Callable[[], str | None] | None = None,
    ) -> None:
        self.pid = pid
        self.pids = PidLedger(pid, pidfd, procs)  # the pid cursor around speculative calls run in place (``procs``: its
        # cgroup's procs file, to see the workspace's own processes)
        self.pidfd = pidfd
        self.workspace_id = workspace_id
        self.stall_timeout = stall_timeout
        self._idle: list[SocketStream] = []
        self._closed = False
        self._open = anyio.Event()  # cleared while a snapshot quiesces the client
        self._open.set()
        self._in_flight = 0
        self._started = 0
        self._unseen = 0  # connections closed without the agent's end-of-file seen since the last ``seen_closed``
        self._drained = anyio.Event()
        self._scopes_open = False  # a quiesce lets the requests of speculative scopes through until they ended
        self._abandoned = False

    def _error(self, message: str, reason: str, req: P.Request | None = None) -> AgentError:
        request = type(req).__name__ if req is not None else ""
        return AgentError(
            f"workspace {self.workspace_id}: {message}", workspace_id=self.workspace_id, reason=reason, request=request
        )

    def _closed_error(self, exc: OSError) -> WorkspaceClosed:
        return WorkspaceClosed(f"workspace {self.workspace_id} does not answer: {exc}", workspace_id=self.workspace_id)

    def _open_socket(self) -> int:
        """An ``O_PATH`` descriptor of the agent's socket inode, found below pid 1's root without following
        anything out of it (module doc). Quick (procfs and one lookup that cannot leave the workspace's root
        mount), so it runs on the event loop as connect(2) on a path did."""
        try:
            root = os.open(f"/proc/{self.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:  # pid 1 is gone
            raise self._closed_error(exc) from exc
        try:
            try:
                signal.pidfd_send_signal(self.pidfd, 0)  # the pid was ours when its root was opened
            except ProcessLookupError as exc:
                raise self._closed_error(exc) from exc
            from .. import _native  # the C extension, loaded when first needed: the pure tests import this module

            resolve = _native.RESOLVE_IN_ROOT | _native.RESOLVE_NO_MAGICLINKS | _native.RESOLVE_NO_XDEV
            try:
                fd = _native.openat2(root, SOCKET, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, resolve)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    raise self._error(f"the agent socket /{SOCKET} is gone: {exc.strerror}", "socket") from exc
                if exc.errno in (errno.ELOOP, errno.EXDEV):
                    raise self._error(
                        f"the way to the agent socket /{SOCKET} was replaced (a symlink or mount leading out of "
                        f"the workspace's root: {exc.strerror}); the host does not follow it",
                        "socket",
                    ) from exc
                raise self._closed_error(exc) from exc
        finally:
            os.close(root)
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            os.close(fd)
            raise self._closed_error(exc) from exc
        if not stat.S_ISSOCK(mode):
            os.close(fd)
            kind = _KINDS.get(stat.S_IFMT(mode), "not a socket")
            raise self._error(
                f"the agent socket /{SOCKET} was replaced by {kind}; the host does not follow or open it", "socket"
            )
        return fd

    async def _connect(self) -> SocketStream:
        if self._idle:
            return self._idle.pop()
        fd = self._open_socket()
        try:
            return await anyio.connect_unix(f"/proc/self/fd/{fd}")
        except OSError as exc:
            raise self._closed_error(exc) from exc
        finally:
            os.close(fd)

    async def request(self, req: P.Request) -> P.Response:
        # a speculative call run in place finishes while a dump waits for it (``quiesce``)
        while not self._open.is_set() and not (self._scopes_open and self.pids.current() is not None):
            await self._open.wait()
        self._in_flight += 1
        self._started += 1
        try:
            await self.pids.before(req)
            try:
                return await self._request(req)
            finally:
                self.pids.after(req)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    async def adopt_pids(self, before: int, after: int) -> ReadPids | None:
        """``PidLedger.adopt`` (a speculative read a sibling ran for this workspace) through the gate (``gated``)."""
        return await self.gated(lambda: self.pids.adopt(before, after))

    async def gated(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        """``fn()``, a reading or move of the pid cursor (``PidLedger``), through the gate requests take: a helper
        in the workspace's pid namespace, so it waits while a snapshot quiesces the client, and one under way counts
        as a call in flight, which the snapshot's drain waits for; the cursor never moves while CRIU dumps the
        tree."""
        while not self._open.is_set():
            await self._open.wait()
        self._in_flight += 1
        self._started += 1
        try:
            return await fn()
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    def mark(self) -> tuple[int, int]:
        """Calls let through so far and calls in flight now: a check of the workspace made at ``mark()`` still holds
        after ``quiesce`` (for what the calls could change) if ``quiet_since`` that mark."""
        return self._started, self._in_flight

    def quiet_since(self, mark: tuple[int, int]) -> bool:
        """No call was in flight at ``mark`` and none has been let through since."""
        return mark == (self._started, 0)

    async def quiesce(self) -> None:
        """Let calls in flight finish, hold new ones until ``resume`` and hang up every idle connection, waiting
        until the agent has closed its end (``_hang_up``), so that it holds no connection to the host (CRIU cannot
        dump one: a snapshot quiesces its workspace's client). Waiting for the agent's end-of-file is exact where
        polling its descriptors for the close took 0.5-2 ms of the snapshot's pause. A speculative call run in
        place (``pids.read``) finishes first, and the pid cursor is settled (a copy starts from the plain loop's)."""
        self._open = anyio.Event()
        self._scopes_open = True
        try:
            while self.pids.active:
                await self.pids.ended.wait()
        finally:
            self._scopes_open = False
        while self._in_flight:
            self._drained = anyio.Event()
            await self._drained.wait()
        await self.pids.settle()
        idle, self._idle = self._idle, []
        try:
            self._unseen += await _hang_up_all(idle)
        finally:
            with anyio.CancelScope(shield=True):
                for conn in idle:
                    await conn.aclose()

    def all_closed(self) -> bool:
        """Whether the agent closed its end of every connection this client has closed (since ``seen_closed``):
        then it holds none, and a dump need not look through the workspace's descriptors for one."""
        return self._unseen == 0

    def seen_closed(self) -> None:
        """The workspace's descriptors were looked through and hold no host connection."""
        self._unseen = 0

    def resume(self) -> None:
        self._open.set()

    async def _request(self, req: P.Request) -> P.Response:
        if self._closed:
            raise WorkspaceClosed(f"workspace {self.workspace_id} is closed", workspace_id=self.workspace_id)
        payload = P.request_encoder.encode(req)
        limit = answer_limit(req, len(payload) - _bulk(req))
        conn = await self._connect()
        resp: P.Response | None = None
        cancelled = False
        try:
            await conn.send(_header.pack(len(payload)) + payload)
            body = await self._receive_frame(conn, req, limit)
            try:
                resp = P.response_decoder.decode(body)
            except Exception as exc:
                raise self._error(f"undecodable answer to {type(req).__name__}: {exc}", "protocol", req) from exc
            if not isinstance(resp, P.Failure | _EXPECTED[type(req)]):
                kind = type(resp).__name__
                resp = None
                raise self._error(f"the agent answered {type(req).__name__} with {kind}", "protocol", req)
        except anyio.get_cancelled_exc_class():
            cancelled = True
            raise
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise WorkspaceClosed(
                f"workspace {self.workspace_id} went away during {type(req).__name__}: {exc!r}",
                workspace_id=self.workspace_id,
            ) from exc
        finally:
            if resp is not None and not self._closed:
                self._idle.append(conn)
            else:  # failed, cancelled or bad: this connection is done, the workspace's others are not
                with anyio.CancelScope(shield=True):
                    if not (cancelled and not self._abandoned and await _hang_up(conn)):
                        self._unseen += 1
                    await conn.aclose()
        assert resp is not None
        return resp

    async def _receive_frame(self, conn: SocketStream, req: P.Request, limit: int) -> bytearray:
        """One answer frame. Its first byte may take as long as the command runs; from then on the frame must
        keep arriving (``stall_timeout``, and ``MIN_RATE`` over the whole frame) and stay within ``limit``."""
        head = bytearray(await conn.receive(4))
        body = bytearray()
        try:
            while len(head) < 4:
                with anyio.fail_after(self.stall_timeout):
                    head += await conn.receive(4 - len(head))
            size = _header.unpack(head)[0]
            if size > limit:
                raise self._error(
                    f"the agent announced a {size}-byte answer to {type(req).__name__}, over the {limit} bytes "
                    "it can legitimately take",
                    "oversized",
                    req,
                )
            whole = self.stall_timeout + size / MIN_RATE  # a trickle that never pauses long is cut too
            with anyio.fail_after(whole):
                while len(body) < size:
                    with anyio.fail_after(self.stall_timeout):
                        body += await conn.receive(min(size - len(body), 1 << 20))
        except TimeoutError as exc:
            raise self._error(
                f"the answer to {type(req).__name__} stalled: nothing arrived for {self.stall_timeout} s mid-frame, "
                f"or it came slower than {MIN_RATE >> 10} KiB/s",
                "stalled",
                req,
            ) from exc
        except anyio.EndOfStream as exc:
            raise self._error(f"the answer to {type(req).__name__} was cut off mid-frame", "truncated", req) from exc
        return body

    async def _close_idle(self) -> None:
        idle, self._idle = self._idle, []
        self._unseen += len(idle)
        for conn in idle:
            await conn.aclose()

    async def rebind(self, pid: int, pidfd: int) -> None:
        """Talk to a new pid 1 from now on (a workspace restored in place under a snapshot, ``_restore.rebase``):
        calls held by ``quiesce`` go to it once resumed, instead of failing on a closed client."""
        await self._close_idle()
        self.pid, self.pidfd = pid, pidfd
        self.pids.rebind(pid, pidfd)

    def abandon(self) -> None:
        """The workspace is about to be destroyed (a discarded speculative fork): a request cancelled from now on
        hangs up without waiting for the agent to reap its command, as its close kills the cgroup anyway. Never for
        a workspace that lives on: its next call could meet the command's processes still exiting."""
        self._abandoned = True

    async def aclose(self) -> None:
        self._closed = True
        self.pids.close()  # before any await: the core closes the pidfd once this returns
        await self._close_idle()
