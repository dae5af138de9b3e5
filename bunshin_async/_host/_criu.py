"""The CRIU interface: one ``criu swrk`` process per dump or restore, driven over its RPC socket from async code.

``criu swrk <fd>`` serves ``criu_req``/``criu_resp`` protobuf messages (images/rpc.proto) on a ``SOCK_SEQPACKET``
socket it inherits, one message per packet. While it works it may send ``NOTIFY`` messages (the RPC form of
``--action-script``); it waits for our ``NOTIFY`` answer, and a failed answer aborts the dump or restore. The
``post-dump`` notification comes while the tree is still frozen, which is where the caller copies the workspace's
files, so that files and memory are one consistent moment.

CRIU resolves ``images_dir_fd`` and ``work_dir_fd`` as ``/proc/<peer>/fd/<n>`` of the process on the other end of the
socket (cr-service.c, ``setup_opts_from_req``), that is, in this process: the descriptors stay open here and are not
passed down. A cancelled call kills CRIU (SIGKILL) and reaps it; ptrace lets go of the tree when CRIU dies, but the
cgroup-v1 freezer does not: a tree CRIU froze (``freeze_cgroup``) stays frozen until someone thaws it. The dump's
caller thaws it (``_dump``); when this process dies, CRIU dies with it (``PARENT_ENV``) and ``bunshin gc`` or the
next process's first workspace start (``_workspace._gc``) thaws the cgroup before it kills what is in it.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import functools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio
import msgspec
from anyio.abc import Process

from .._config import Config
from .._exceptions import CapabilityMissing, ForkError, InvalidValue
from . import _hostsetup, _paths

__all__ = [
    "COW_RESTORE",
    "CriuBackend",
    "FdHandler",
    "NotifyHandler",
    "AnswerHandler",
    "ReadyHandler",
    "SwrkCriu",
    "criu_features",
    "criu_unavailable",
    "criu_version",
    "rpc",
]

_pycriu_dir = _paths.pycriu_dir()
if _pycriu_dir is not None and _pycriu_dir.is_dir() and str(_pycriu_dir) not in sys.path:
    sys.path.append(str(_pycriu_dir))
try:
    from pycriu import rpc_pb2 as rpc
except ImportError:  # pragma: no cover - depends on the build
    rpc = None

NotifyHandler = Callable[[str, int], Awaitable[None]]
"""Called with the notification's name (``post-dump``, ``setup-namespaces``, ...) and its pid (0 when none); raising
fails the CRIU call."""

ReadyHandler = Callable[[], Awaitable[None]]
"""Awaited once CRIU runs and waits for the request (``SwrkCriu.call``'s ``ready``)."""

AnswerHandler = Callable[[Any], None]
"""Called with CRIU's successful answer as soon as it comes, before CRIU has exited and been reaped (a dump's tree
is thawed by then: the caller may let the workspace go on while CRIU exits)."""

FdHandler = Callable[[str, int, int], None]
"""Called with a notification's name, its pid and a descriptor CRIU attached to it (``wp-uffd``,
criu/patches/0013), which it then owns; without one such descriptors are closed."""

MAX_MSG = 1 << 20
PARENT_ENV = "BUNSHIN_PARENT_PID"
"""Names this process to ``bunshin-init`` (native/init.c, ``die_with_parent``), the first program of every CRIU
call: it sets ``PR_SET_PDEATHSIG(SIGKILL)``, kept across its exec of CRIU, so a CRIU whose host was killed outright
does not go on with the tree frozen and seized or restore a copy nobody owns. The signal comes when the thread that
forked CRIU exits: anyio's asyncio backend forks from the event loop's thread, which outlives the call."""
LOG_TAIL = 4000
# Options rpc.proto lacks go through a config file (``criu_opts.config_file``); none are needed today.


def _require_rpc() -> Any:
    if rpc is None:
        raise CapabilityMissing("pycriu is not importable", capability="criu", remedy=_hostsetup.SETUP_COMMAND)
    return rpc


def _criu() -> Path:
    path = _paths.criu_binary()
    if path is None or not path.exists():
        raise CapabilityMissing("criu 4.2.1 not found", capability="criu", remedy=_hostsetup.SETUP_COMMAND)
    return path


COW_RESTORE = "cow-restore"
"""The feature criu/patches/0001-cow-restore.patch adds (``criu --version`` prints ``Features: cow-restore``): with
``CRIU_COW_RESTORE=1`` a restore maps private anonymous memory ``MAP_PRIVATE`` from the (immutable, tmpfs) pages
image, so copies share pages until they write them; with ``CRIU_COW_ANON_PREFIX=<dir>/`` a dump treats mappings of
pages images under that dir as anonymous memory (forks of such copies)."""


class _Probe(msgspec.Struct, frozen=True):
    """What one ``criu --version`` said: its version, the ``Features:`` it lists, why it cannot be used (None when
    it answered)."""

    version: str | None
    features: frozenset[str]
    unusable: str | None


_probe_cache: dict[tuple[str, int, int], _Probe] = {}


def _probe(path: Path) -> _Probe:
    """One ``criu --version`` per binary (path, mtime, size, so a rebuild is noticed). Raises ``OSError`` when
    ``path`` cannot be stat'ed."""
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    cached = _probe_cache.get(key)
    if cached is not None:
        return cached
    version: str | None = None
    found: set[str] = set()
    reason: str | None = None
    try:
        res = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=10)
    except OSError as exc:
        reason = f"cannot run {path}: {exc.strerror}"
    except subprocess.TimeoutExpired:
        reason = f"`{path} --version` did not answer within 10 s"
    else:
        if res.returncode:
            tail = (res.stderr or res.stdout).strip()[-200:]
            reason = f"`{path} --version` exited with status {res.returncode}: {tail}"
        for line in res.stdout.splitlines():
            if line.startswith("Version:"):
                version = line.split(":", 1)[1].strip()
            elif line.startswith("Features:"):
                found.update(line.split(":", 1)[1].split())
    _probe_cache[key] = _Probe(version, frozenset(found), reason)
    return _probe_cache[key]


def criu_version(path: Path | None = None) -> str | None:
    """The version ``criu --version`` prints (None when it cannot be run); cached per binary."""
    path = path or _paths.criu_binary()
    if path is None:
        return None
    try:
        return _probe(path).version
    except OSError:
        return None


def criu_features(path: Path | None = None) -> frozenset[str]:
    """The ``Features:`` that ``criu --version`` lists (none for a stock CRIU or none found); cached per binary."""
    path = path or _paths.criu_binary()
    if path is None:
        return frozenset()
    try:
        return _probe(path).features
    except OSError:
        return frozenset()


def criu_unavailable(path: Path | None = None) -> str | None:
    """Why CRIU cannot be used on this host (pycriu missing, no binary, ``criu --version`` failing), or None when
    it can; cached per binary like ``criu_features``. ``restore_mode`` falls back to filesystem-only forks on a
    reason."""
    if rpc is None:
        return f"pycriu is not importable (run `{_hostsetup.SETUP_COMMAND}`)"
    path = path or _paths.criu_binary()
    if path is None:
        return f"criu not found (run `{_hostsetup.SETUP_COMMAND}`, or set BUNSHIN_CRIU)"
    try:
        return _probe(path).unusable or patch_mismatch(path)
    except OSError as exc:
        return f"{path}: {exc.strerror} (run `{_hostsetup.SETUP_COMMAND}`, or set BUNSHIN_CRIU)"


@functools.lru_cache(maxsize=1)
def package_patch_set() -> str | None:
    """The CRIU patch set this package was built with (its criu/ tree; None when it has none)."""
    try:
        return _hostsetup.patch_set()
    except OSError:
        return None


def patch_mismatch(path: Path) -> str | None:
    """Why the host's CRIU install (host.toml) does not fit this package: built from another patch set. A CRIU
    named by ``BUNSHIN_CRIU`` or a checkout's own build is taken as it is."""
    recorded = _paths.host_config().get("criu", {})
    if os.environ.get("BUNSHIN_CRIU") or recorded.get("path") != str(path):
        return None
    want, have = package_patch_set(), recorded.get("patches")
    if want is None or have == want:
        return None
    return (
        f"the host's CRIU ({path}) carries patch set {have}, this package needs {want} "
        f"(run `{_hostsetup.SETUP_COMMAND}` with this package)"
    )


def log_tail(path: Path, limit: int = LOG_TAIL) -> str:
    """The last ``limit`` characters of a CRIU log, without the harmless RLIMIT_NOFILE noise (no CAP_SYS_RESOURCE)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * limit))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if "RLIMIT_NOFILE" not in ln]
    return "\n".join(lines)[-limit:]


def _ended(returncode: int | None) -> str:
    """How a CRIU process ended, for an error message."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _plain_wrapper() -> list[str]:
    """The wrapper of a call that has none: ``bunshin-init --join`` with no cgroup only execs CRIU, after
    ``PARENT_ENV``."""
    return [str(_paths.init_binary()), "--join", "--"]


class HookFailed(Exception):
    """A notification handler raised; CRIU was told and rolls back."""


class CriuBackend(Protocol):
    """Runs one CRIU request to its end. ``wrapper`` is a command prefix that ends by exec'ing its last argument
    list (for a restore: join the cgroup and mount the root in a private mount namespace, then ``exec criu``), and
    runs ``bunshin-init`` first or execs it with the environment kept (``PARENT_ENV``);
    ``env`` is added to CRIU's environment (the patches' switches). ``ready``, when given, is awaited once CRIU has
    started and waits for the request, which is sent when it returns: the caller's last steps before a dump (the
    drain that pauses the workspace) overlap CRIU's start instead of waiting for it. A cancellation or an error in
    ``ready`` kills CRIU, which has touched nothing yet; from the request on the call is shielded (a dump's CRIU
    must not be killed while its parasite runs), so such a caller does not shield the call itself. ``answered``,
    when given, is called with a successful answer before CRIU is reaped (its exit took 0.2-4 ms here)."""

    async def call(
        self,
        req: Any,
        *,
        work_dir: Path,
        log_name: str,
        workspace_id: str,
        notify: NotifyHandler | None = None,
        wrapper: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        on_fd: FdHandler | None = None,
        ready: ReadyHandler | None = None,
        answered: AnswerHandler | None = None,
    ) -> Any: ...


class SwrkCriu:
    """The real backend: ``criu swrk`` over a socketpair. ``on_spawn`` (fault injection, benchmarks) is called
    with CRIU's pid once it runs."""

    def __init__(self, on_spawn: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.on_spawn = on_spawn

    async def call(
        self,
        req: Any,
        *,
        work_dir: Path,
        log_name: str,
        workspace_id: str,
        notify: NotifyHandler | None = None,
        wrapper: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        on_fd: FdHandler | None = None,
        ready: ReadyHandler | None = None,
        answered: AnswerHandler | None = None,
    ) -> Any:
        pb = _require_rpc()
        if "/" in log_name:
            raise InvalidValue("CRIU's log_file is a plain name inside work_dir", argument="log_name")
        criu = _criu()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        work_fd = os.open(work_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        proc: Process | None = None
        done = False
        readying = False  # an OSError of ``ready`` is the caller's, not CRIU dying
        what = pb.criu_req_type.Name(req.type).lower()
        try:
            req.opts.work_dir_fd = work_fd
            req.opts.log_file = log_name
            ours.setblocking(False)
            if theirs.fileno() < 10:  # fds 3-9 are the wrapper's to use (NET_FD)
                high = fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
                theirs.close()
                theirs = socket.socket(fileno=high)
            # bunshin-init, first in a wrapper or alone (one static exec, 0.4 ms here, loaded; a dump overlaps it
            # with its drain), gives CRIU its parent-death signal (PARENT_ENV)
            argv = [*(wrapper or _plain_wrapper()), str(criu), "swrk", str(theirs.fileno())]
            try:
                proc = await anyio.open_process(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    pass_fds=(theirs.fileno(),),
                    env={**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())},
                )
            finally:
                theirs.close()
            if self.on_spawn is not None:
                await self.on_spawn(proc.pid)
            if ready is not None:
                # A VERSION request kept open (cr-service.c, chk_keepopen_req) is answered once CRIU has exec'd,
                # initialised and probed the kernel (criu/patches/0025), and has done what the dump's environment
                # asks before the freeze (the tree's smaps, the parent's pagemaps, the user namespace check:
                # 0015, 0027, 0028); it then waits for the next request.
                hello = pb.criu_req(type=pb.VERSION, keep_open=True)
                with anyio.fail_after(timeout):
                    await self._converse_while_alive(proc, ours, hello, None, None, pb)
                readying = True
                await ready()
                readying = False
            with anyio.CancelScope(shield=ready is not None), anyio.fail_after(timeout):
                resp = await self._converse_while_alive(proc, ours, req, notify, on_fd, pb)
            if not resp.success:
                raise self._error(
                    f"criu {what} failed", work_dir / log_name, workspace_id, resp.cr_errno, resp.cr_errmsg
                )
            done = True
            if answered is not None:
                answered(resp)
            return resp
        except TimeoutError as exc:
            if readying:
                raise
            raise self._error(f"criu {what} timed out after {timeout} s", work_dir / log_name, workspace_id) from exc
        except HookFailed as exc:
            raise self._error(f"criu {what}: {exc}", work_dir / log_name, workspace_id) from exc
        except (OSError, anyio.EndOfStream) as exc:
            if readying:
                raise
            stderr = b""
            if proc is not None:
                with anyio.move_on_after(1, shield=True):
                    if proc.stderr is not None:
                        try:
                            stderr = await proc.stderr.receive(4096)
                        except (anyio.EndOfStream, anyio.ClosedResourceError, OSError):
                            pass
                    await proc.wait()
            how = _ended(proc.returncode if proc is not None else None)
            err = self._error(
                f"criu {what} died ({how}; {exc!r}) {stderr.decode(errors='replace').strip()}".rstrip(),
                work_dir / log_name,
                workspace_id,
            )
            raise err from exc
        finally:
            ours.close()
            os.close(work_fd)
            if proc is not None:
                with anyio.CancelScope(shield=True):
                    await _reap(proc, kill=not done)

    async def _converse_while_alive(
        self,
        proc: Process,
        sk: socket.socket,
        req: Any,
        notify: NotifyHandler | None,
        on_fd: FdHandler | None,
        pb: Any,
    ) -> Any:
        """The conversation, ended early if CRIU dies: a task CRIU already cloned may hold a copy of its socket,
        so its death does not always show as end-of-stream."""
        outcome: list[Any] = []
        errors: list[Exception] = []
        async with anyio.create_task_group() as tg:

            async def converse() -> None:
                try:
                    outcome.append(await self._converse(sk, req, notify, on_fd, pb))
                except Exception as exc:
                    errors.append(exc)
                tg.cancel_scope.cancel()

            async def watch() -> None:
                await proc.wait()
                await anyio.sleep(0.05)  # let a last packet already sent be read
                tg.cancel_scope.cancel()

            tg.start_soon(converse)
            tg.start_soon(watch)
        if errors:
            raise errors[0]
        if not outcome:
            raise anyio.EndOfStream
        return outcome[0]

    async def _converse(
        self, sk: socket.socket, req: Any, notify: NotifyHandler | None, on_fd: FdHandler | None, pb: Any
    ) -> Any:
        await _send(sk, req.SerializeToString())
        while True:
            data, fds = await _recv(sk)
            resp = pb.criu_resp()
            try:
                resp.ParseFromString(data)
            except Exception:
                _close_all(fds)
                raise
            if resp.type != pb.NOTIFY:
                _close_all(fds)
                return resp
            for i, fd in enumerate(fds):
                if on_fd is None:
                    os.close(fd)
                    continue
                try:
                    on_fd(resp.notify.script, resp.notify.pid, fd)
                except BaseException:
                    _close_all(fds[i + 1 :])
                    raise
            if notify is not None:
                try:
                    await notify(resp.notify.script, resp.notify.pid)
                except Exception as exc:
                    answer = pb.criu_req(type=pb.NOTIFY, notify_success=False)
                    with contextlib.suppress(OSError):
                        await _send(sk, answer.SerializeToString())
                    raise HookFailed(f"the {resp.notify.script} hook failed: {exc!r}") from exc
            await _send(sk, pb.criu_req(type=pb.NOTIFY, notify_success=True).SerializeToString())

    @staticmethod
    def _error(message: str, log: Path, workspace_id: str, cr_errno: int = 0, cr_errmsg: str = "") -> ForkError:
        tail = log_tail(log)
        detail = f"{message}" + (f" (errno {cr_errno}: {cr_errmsg or os.strerror(cr_errno)})" if cr_errno else "")
        # The log's last error line (``Error (file:line): ...``) on the first line: a one-line report says why.
        errors = [ln.strip() for ln in tail.splitlines() if "Error" in ln or "unexpectedly" in ln]
        if errors:
            detail += f": {errors[-1]}"
        return ForkError(
            f"{detail}; CRIU log {log}:\n{tail}" if tail else detail,
            workspace_id=workspace_id,
            cr_errno=cr_errno,
            log_tail=tail,
        )


async def _send(sk: socket.socket, data: bytes) -> None:
    while True:
        try:
            sk.send(data)
            return
        except BlockingIOError:
            await anyio.wait_writable(sk)


async def _recv(sk: socket.socket) -> tuple[bytes, list[int]]:
    """One packet and the descriptors CRIU attached to it (close-on-exec), which the caller owns."""
    fds = array.array("i")
    while True:
        try:
            data, anc, _flags, _addr = sk.recvmsg(MAX_MSG, socket.CMSG_SPACE(4 * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
            break
        except BlockingIOError:
            await anyio.wait_readable(sk)
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        _close_all(list(fds))
        raise anyio.EndOfStream
    return data, list(fds)


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


async def _reap(proc: Process, kill: bool) -> None:
    """CRIU exits by itself once its socket closes; a failed, cancelled or stuck one is killed."""
    if not kill:
        with anyio.move_on_after(5):
            await proc.wait()
    if proc.returncode is None:
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
    await proc.aclose()


def default_backend() -> CriuBackend:
    return SwrkCriu()


def base_opts(req: Any) -> None:
    """The options every dump and restore of a workspace shares (log level: ``Config.criu_log_level``)."""
    req.opts.log_level = Config.current().criu_log_level
    req.opts.tcp_established = True
    req.opts.file_locks = True
    req.opts.manage_cgroups = True
    req.opts.manage_cgroups_mode = rpc.IGNORE
