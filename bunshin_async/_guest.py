"""The agent that runs inside every workspace and serves tool requests on a Unix socket.

It is started by the workspace's pid 1 as ``python3 -I -S agent.py`` with ``lib/`` (msgspec and ``_protocol``) beside
it, so it imports nothing from the host package. It avoids ``subprocess`` (whose imports cost ~20 ms of start-up and
a few MiB in every workspace) and spawns with posix_spawn itself. One thread serves each connection; the host opens
one connection per request in flight. File tools are confined to ``BUNSHIN_WORKDIR``; commands are not (the whole
workspace is the sandbox).
"""

from __future__ import annotations

import errno
import fcntl
import os
import selectors
import signal
import socket
import stat
import struct
import threading
import time
from typing import Any

if __package__:
    from . import _protocol as P
else:  # inside the workspace, as lib/bunshin_guest.py beside msgspec and _protocol
    import _protocol as P  # type: ignore[import-not-found,no-redef]

SOCKET_PATH = "/run/bunshin/agent.sock"
WORKDIR = os.environ.get("BUNSHIN_WORKDIR", "/workspace")
BASH = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
}
F_SETPIPE_SZ = 1031
DRAIN_CHUNK = 1 << 20
_header = struct.Struct(">I")


class Fail(Exception):
    def __init__(self, error: str, message: str, path: str | None = None, stdout: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.failure = P.Failure(error=error, message=message, path=path, stdout=stdout, stderr=stderr)


# ---------------------------------------------------------------------------------------------------- paths


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def resolve(path: str) -> str:
    """Map a tool path onto the workspace directory, refusing ``..`` and symlinks that lead outside it."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise Fail("invalid", f"invalid path {path!r}", path=str(path))
    joined = path if path.startswith("/") else os.path.join(WORKDIR, path)
    norm = os.path.normpath(joined)
    if not _within(norm, WORKDIR):
        raise Fail("path_outside", f"{path!r} is outside the workspace directory {WORKDIR}", path=path)
    real = os.path.realpath(norm)
    if not _within(real, WORKDIR):
        raise Fail("path_outside", f"{path!r} resolves to {real!r}, outside {WORKDIR}", path=path)
    return real


def _os_fail(exc: OSError, path: str) -> Fail:
    if isinstance(exc, FileNotFoundError):
        return Fail("not_found", f"no such file or directory: {path!r}", path=path)
    if isinstance(exc, (IsADirectoryError, NotADirectoryError, FileExistsError)) or exc.errno == errno.ENOTEMPTY:
        return Fail("invalid", f"{exc.strerror}: {path!r}", path=path)
    return Fail("os", f"{exc.strerror or exc}: {path!r}", path=path)


# ---------------------------------------------------------------------------------------------------- commands


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(BASE_ENV)
    if extra:
        env.update(extra)
    return env


def _cwd(cwd: str | None) -> str:
    cwd = cwd or WORKDIR
    if not os.path.isdir(cwd):
        raise Fail("not_found", f"working directory {cwd!r} does not exist", path=cwd)
    return cwd


def _argv(argv: list[str] | None, command: str | None) -> list[str]:
    if (argv is None) == (command is None):
        raise Fail("invalid", "give exactly one of argv or command")
    if argv is not None:
        if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
            raise Fail("invalid", f"invalid argv {argv!r}")
        return argv
    assert command is not None
    if "\0" in command:
        raise Fail("invalid", "command contains a NUL byte")
    return [BASH, "-c", command]


class Proc:
    """A child started by ``spawn``: its pid (also its process group and session) and a pidfd to wait on."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                os.close(self.pidfd)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
            os.close(self.pidfd)
        return self.returncode


EXEC_HELPER = "/opt/bunshin/bunshin-init"


def _which(name: str, path: str, cwd: str) -> str:
    """The file ``name`` runs, found as execvp would (relative names against ``cwd``)."""
    candidates = [os.path.join(cwd, name)] if "/" in name else [os.path.join(d or cwd, name) for d in path.split(":")]
    for c in candidates:
        if os.path.isfile(c):
            if not os.access(c, os.X_OK):
                raise Fail("invalid", f"cannot execute {name!r}: permission denied", path=name)
            return os.path.normpath(c)
    raise Fail("not_found", f"command not found: {name!r}", path=name)


def spawn(argv: list[str], cwd: str, env: dict[str, str], stdin: int, stdout: int, stderr: int) -> Proc:
    """posix_spawn (vfork: no copy-on-write faults from a child running Python) ``argv`` in a new session with
    the given descriptors on 0, 1 and 2. Every other descriptor of the agent is close-on-exec (PEP 446). A cwd
    other than the agent's own goes through the exec helper, which chdir()s and execs."""
    cwd = os.path.realpath(os.path.join(WORKDIR, cwd))
    exe = _which(argv[0], env.get("PATH", BASE_ENV["PATH"]), cwd)
    if cwd != os.getcwd():
        argv, exe = [EXEC_HELPER, "--exec", cwd, exe, *argv], EXEC_HELPER
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in ((0, stdin), (1, stdout), (2, stderr))]
    try:
        pid = os.posix_spawn(exe, argv, env, file_actions=actions, setsid=True, setsigdef=(signal.SIGPIPE,))
    except OSError as exc:
        raise Fail("os", f"cannot run {argv[0]!r}: {exc.strerror}", path=argv[0]) from None
    return Proc(pid)


class _Pipes:
    """The parent ends of a child's stdio pipes (None where the child got /dev/null)."""

    def __init__(self, with_stdin: bool) -> None:
        self.null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        self.in_r, self.in_w = os.pipe2(os.O_CLOEXEC) if with_stdin else (self.null, -1)
        self.out_r, self.out_w = os.pipe2(os.O_CLOEXEC)
        self.err_r, self.err_w = os.pipe2(os.O_CLOEXEC)

    def child_ends(self) -> tuple[int, int, int]:
        return self.in_r, self.out_w, self.err_w

    def close_child_ends(self) -> None:
        for fd in {self.in_r, self.out_w, self.err_w, self.null}:
            os.close(fd)

    def close(self) -> None:
        for fd in (self.in_w, self.out_r, self.err_r):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.in_w = self.out_r = self.err_r = -1


class _Collector:
    """Reads a process's stdout and stderr, keeping the first ``cap`` bytes of each and dropping the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = max(0, cap)
        self.data: dict[int, bytearray] = {}
        self.truncated = False

    def add(self, key: int, chunk: bytes) -> None:
        buf = self.data.setdefault(key, bytearray())
        room = self.cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        if len(chunk) > room:
            self.truncated = True

    def text(self, key: int) -> str:
        return bytes(self.data.get(key, b"")).decode("utf-8", "replace")


def run_exec(req: P.Exec, cancel: socket.socket | None = None) -> P.ExecResult:
    argv = _argv(req.argv, req.command)
    cwd = _cwd(req.cwd)
    start = time.monotonic()
    pipes = _Pipes(with_stdin=req.stdin is not None)
    try:
        try:
            proc = spawn(argv, cwd, _env(req.env), *pipes.child_ends())
        finally:
            pipes.close_child_ends()
        out = _Collector(req.max_output)
        timed_out = _pump(proc, pipes, req.stdin, out, req.timeout, cancel)
    finally:
        pipes.close()
    duration = time.monotonic() - start
    if timed_out:
        raise Fail(
            "timeout",
            f"command timed out after {req.timeout} s",
            stdout=out.text(1),
            stderr=out.text(2),
        )
    return P.ExecResult(
        exit_code=_exit_code(proc.returncode),
        stdout=out.text(1),
        stderr=out.text(2),
        duration=duration,
        truncated=out.truncated,
    )


def _exit_code(returncode: int | None) -> int:
    """Shell convention: a signal-killed process reports 128 + signal (137 for SIGKILL)."""
    if returncode is None:
        return -1
    return returncode if returncode >= 0 else 128 - returncode


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _hung_up(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _pump(
    proc: Proc,
    pipes: _Pipes,
    stdin: bytes | None,
    out: _Collector,
    timeout: float | None,
    cancel: socket.socket | None,
) -> bool:
    """Feed stdin and collect output until the process exits (not until EOF: a background child may keep the
    pipes open). Returns True if the deadline passed and the process group was killed. A hang-up on ``cancel``
    (the host cancelled the call) kills the process group too."""
    deadline = None if timeout is None else time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    streams = {pipes.out_r: 1, pipes.err_r: 2}
    for fd in streams:
        try:
            fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(proc.pidfd, selectors.EVENT_READ)
    if cancel is not None:
        sel.register(cancel, selectors.EVENT_READ)
    pending = memoryview(stdin or b"")
    if pipes.in_w >= 0:
        os.set_blocking(pipes.in_w, False)
        if pending:
            sel.register(pipes.in_w, selectors.EVENT_WRITE)
        else:
            os.close(pipes.in_w)
            pipes.in_w = -1
    timed_out = exited = False
    try:
        while not exited:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                timed_out = True
                _killpg(proc.pid)
                break
            for key, _ in sel.select(wait):
                fd = key.fd
                if fd == proc.pidfd:
                    exited = True
                elif cancel is not None and fd == cancel.fileno():
                    if _hung_up(cancel):
                        _killpg(proc.pid)
                        exited = True
                    else:
                        sel.unregister(cancel)
                elif fd == pipes.in_w:
                    try:
                        n = os.write(fd, pending)
                    except BlockingIOError:
                        n = 0
                    except BrokenPipeError:
                        n = len(pending)
                    pending = pending[n:]
                    if not pending:
                        sel.unregister(fd)
                        os.close(fd)
                        pipes.in_w = -1
                elif fd in streams:
                    _read_some(fd, streams, sel, out)
        # The process is gone (or killed): take what is already in the pipes, without waiting for EOF.
        for fd in list(streams):
            while fd in streams and _read_some(fd, streams, sel, out):
                pass
    finally:
        sel.close()
        proc.wait()
    return timed_out


def _read_some(fd: int, streams: dict[int, int], sel: selectors.BaseSelector, out: _Collector) -> bool:
    try:
        chunk = os.read(fd, DRAIN_CHUNK)
    except BlockingIOError:
        return False
    if not chunk:
        sel.unregister(fd)
        del streams[fd]
        return False
    out.add(streams[fd], chunk)
    return True


# ---------------------------------------------------------------------------------------------------- shells


def _ansi_c_quote(s: str) -> str:
    """Quote ``s`` as bash's $'...' so that eval sees it byte for byte, heredocs and quotes included."""
    out = []
    for ch in s:
        if ch == "\\":
            out.append("\\\\")
        elif ch == "'":
            out.append("\\'")
        elif ch == "\n":
            out.append("\\n")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


class Shell:
    """A persistent bash whose cwd, environment and variables survive between commands."""

    def __init__(self, cwd: str, env: dict[str, str]) -> None:
        self.pipes = _Pipes(with_stdin=True)
        try:
            self.proc = spawn([BASH, "--noprofile", "--norc"], cwd, env, *self.pipes.child_ends())
        except BaseException:
            self.pipes.close()
            raise
        finally:
            self.pipes.close_child_ends()
        self.lock = threading.Lock()
        for fd in (self.pipes.out_r, self.pipes.err_r):
            os.set_blocking(fd, False)

    def run(self, req: P.ShellRun) -> P.ExecResult:
        with self.lock:
            return self._run(req)

    def _run(self, req: P.ShellRun) -> P.ExecResult:
        if self.proc.poll() is not None:
            raise Fail("invalid", "the shell session has exited")
        marker = "__bunshin_" + os.urandom(10).hex() + "__"
        script = (
            f"eval {_ansi_c_quote(req.command)} </dev/null\n"
            f"printf '{marker}%d\\n' $?\nprintf '{marker}\\n' >&2\n"
        )
        start = time.monotonic()
        try:
            data = memoryview(script.encode())
            while data:
                data = data[os.write(self.pipes.in_w, data) :]
        except BrokenPipeError:
            raise Fail("invalid", "the shell session has exited") from None
        deadline = None if req.timeout is None else start + req.timeout
        fds = {self.pipes.out_r: 1, self.pipes.err_r: 2}
        raw: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        done: dict[int, int] = {}
        mark = marker.encode()
        killed = False
        sel = selectors.DefaultSelector()
        for fd in fds:
            sel.register(fd, selectors.EVENT_READ)
        try:
            while len(done) < 2:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    if killed:  # the shell itself does not answer: end it
                        _killpg(self.proc.pid)
                        self.proc.wait()
                        break
                    killed = True
                    _kill_descendants(self.proc.pid)
                    deadline = time.monotonic() + 2.0
                    continue
                events = sel.select(wait)
                for key, _ in events:
                    try:
                        chunk = os.read(key.fd, DRAIN_CHUNK)
                    except BlockingIOError:
                        continue
                    stream = fds[key.fd]
                    if not chunk:  # the shell exited (``exit`` or killed)
                        sel.unregister(key.fd)
                        done.setdefault(stream, len(raw[stream]))
                        continue
                    buf = raw[stream]
                    buf += chunk
                    if stream not in done:
                        pos = buf.find(mark)
                        if pos >= 0 and (stream == 2 or buf.find(b"\n", pos) >= 0):
                            done[stream] = pos
        finally:
            sel.close()
        cap = max(0, req.max_output)
        out_b, err_b = bytes(raw[1][: done.get(1, len(raw[1]))]), bytes(raw[2][: done.get(2, len(raw[2]))])
        truncated = len(out_b) > cap or len(err_b) > cap
        stdout, stderr = out_b[:cap].decode("utf-8", "replace"), err_b[:cap].decode("utf-8", "replace")
        if killed:
            raise Fail("timeout", f"shell command timed out after {req.timeout} s", stdout=stdout, stderr=stderr)
        if 1 in done and raw[1].find(mark) >= 0:
            tail = raw[1][done[1] + len(mark) :].split(b"\n", 1)[0]
            exit_code = int(tail or b"0")
        else:
            exit_code = _exit_code(self.proc.wait())
        return P.ExecResult(
            exit_code=exit_code,
            stdout=stdout,
            stderr=stderr,
            duration=time.monotonic() - start,
            truncated=truncated,
        )

    def close(self) -> None:
        _killpg(self.proc.pid)
        self.proc.wait()
        self.pipes.close()


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return kids


def _kill_descendants(pid: int) -> None:
    stack, seen = _children(pid), set()
    while stack:
        child = stack.pop()
        if child in seen:
            continue
        seen.add(child)
        stack.extend(_children(child))
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------------------------------- server


class Agent:
    def __init__(self) -> None:
        self.shells: dict[int, Shell] = {}
        self.spawned: dict[int, Proc] = {}
        self.lock = threading.Lock()
        self.next_shell = 1

    def reap(self) -> None:
        """Collect background processes that exited (they are our children, not pid 1's)."""
        with self.lock:
            for proc in self.spawned.values():
                if proc.returncode is None:
                    proc.poll()

    def handle(self, req: Any, conn: socket.socket | None = None) -> P.Response:  # noqa: C901 - one dispatch
        self.reap()
        if isinstance(req, P.Exec):
            return run_exec(req, conn)
        if isinstance(req, P.ShellRun):
            shell = self.shells.get(req.shell_id)
            if shell is None:
                raise Fail("invalid", f"no shell session {req.shell_id}")
            return shell.run(req)
        if isinstance(req, P.ReadFile):
            return self.read_file(req)
        if isinstance(req, P.WriteFile):
            return self.write_file(req)
        if isinstance(req, P.ListDir):
            return self.list_dir(req)
        if isinstance(req, P.Remove):
            return self.remove(req)
        if isinstance(req, P.ShellOpen):
            shell = Shell(_cwd(req.cwd), _env(req.env))
            with self.lock:
                shell_id, self.next_shell = self.next_shell, self.next_shell + 1
                self.shells[shell_id] = shell
            return P.ShellOpened(shell_id=shell_id)
        if isinstance(req, P.ShellClose):
            with self.lock:
                shell = self.shells.pop(req.shell_id, None)
            if shell is not None:
                shell.close()
            return P.Ok()
        if isinstance(req, P.Spawn):
            return self.spawn(req)
        if isinstance(req, P.Poll):
            return self.poll(req.pid)
        if isinstance(req, P.Signal):
            if req.pid not in self.spawned:
                raise Fail("invalid", f"no background process {req.pid}")
            try:
                os.killpg(req.pid, req.signal)
            except ProcessLookupError:
                pass
            except (ValueError, OSError) as exc:
                raise Fail("invalid", f"cannot send signal {req.signal}: {exc}") from None
            return P.Ok()
        if isinstance(req, P.Ping):
            if req.version != P.PROTOCOL_VERSION:
                raise Fail("protocol", f"host speaks protocol {req.version}, agent {P.PROTOCOL_VERSION}")
            return P.Pong(version=P.PROTOCOL_VERSION, pid=os.getpid())
        raise Fail("invalid", f"unknown request {type(req).__name__}")

    def read_file(self, req: P.ReadFile) -> P.FileData:
        path = resolve(req.path)
        try:
            with open(path, "rb") as f:
                if req.max_bytes is None:
                    return P.FileData(data=f.read())
                data = f.read(req.max_bytes + 1)
        except OSError as exc:
            raise _os_fail(exc, req.path) from None
        return P.FileData(data=data[: req.max_bytes], truncated=len(data) > req.max_bytes)

    def write_file(self, req: P.WriteFile) -> P.Ok:
        path = resolve(req.path)
        if path == WORKDIR:
            raise Fail("invalid", "cannot write the workspace directory itself", path=req.path)
        try:
            if req.make_parents:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if req.append else os.O_TRUNC)
            fd = os.open(path, flags, 0o644 if req.mode is None else req.mode)
            try:
                view = memoryview(req.data)
                while view:
                    view = view[os.write(fd, view) :]
                if req.mode is not None:
                    os.fchmod(fd, req.mode)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _os_fail(exc, req.path) from None
        return P.Ok()

    def list_dir(self, req: P.ListDir) -> P.DirListing:
        path = resolve(req.path)
        entries = []
        try:
            with os.scandir(path) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    kind = (
                        "symlink"
                        if stat.S_ISLNK(st.st_mode)
                        else "dir"
                        if stat.S_ISDIR(st.st_mode)
                        else "file"
                        if stat.S_ISREG(st.st_mode)
                        else "other"
                    )
                    entries.append(P.DirEntry(name=e.name, kind=kind, size=st.st_size))
        except OSError as exc:
            raise _os_fail(exc, req.path) from None
        entries.sort(key=lambda e: e.name)
        return P.DirListing(entries=entries)

    def remove(self, req: P.Remove) -> P.Ok:
        norm = os.path.normpath(req.path if req.path.startswith("/") else os.path.join(WORKDIR, req.path))
        # A symlink is removed itself, never followed: resolve only its parent.
        path = os.path.join(resolve(os.path.dirname(norm)), os.path.basename(norm))
        if not _within(os.path.normpath(path), WORKDIR) or os.path.normpath(path) == WORKDIR:
            raise Fail("path_outside" if path != WORKDIR else "invalid", f"cannot remove {req.path!r}", path=req.path)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                if req.recursive:
                    import shutil  # only here: it costs start-up time in every workspace

                    shutil.rmtree(path)
                else:
                    os.rmdir(path)
            else:
                os.unlink(path)
        except OSError as exc:
            raise _os_fail(exc, req.path) from None
        return P.Ok()

    def spawn(self, req: P.Spawn) -> P.Spawned:
        argv = _argv(req.argv, req.command)
        cwd = _cwd(req.cwd)
        log = resolve(req.log_path) if req.log_path else os.devnull
        try:
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _os_fail(exc, req.log_path or log) from None
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            proc = spawn(argv, cwd, _env(req.env), null, out, out)
        finally:
            os.close(out)
            os.close(null)
        with self.lock:
            self.spawned[proc.pid] = proc
        return P.Spawned(pid=proc.pid)

    def poll(self, pid: int) -> P.PollResult:
        proc = self.spawned.get(pid)
        if proc is None:
            raise Fail("invalid", f"no background process {pid}")
        rc = proc.poll()
        return P.PollResult(returncode=None if rc is None else _exit_code(rc))

    def serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                header = _recv_exact(conn, 4)
                if header is None:
                    return
                body = _recv_exact(conn, _header.unpack(header)[0])
                if body is None:
                    return
                try:
                    resp: P.Response = self.handle(P.request_decoder.decode(body), conn)
                except Fail as exc:
                    resp = exc.failure
                except Exception as exc:  # never let one bad request kill the agent
                    kind = "protocol" if type(exc).__module__.startswith("msgspec") else "internal"
                    resp = P.Failure(error=kind, message=f"{type(exc).__name__}: {exc}")
                payload = P.response_encoder.encode(resp)
                try:
                    conn.sendall(_header.pack(len(payload)) + payload)
                except OSError:
                    return


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = conn.recv(n - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.makedirs(os.path.dirname(SOCKET_PATH), mode=0o700, exist_ok=True)
    os.makedirs(WORKDIR, exist_ok=True)
    os.chdir(WORKDIR)  # commands run here without the exec helper
    try:
        os.unlink(SOCKET_PATH)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(SOCKET_PATH)
    server.listen(128)
    agent = Agent()
    try:
        os.write(3, b"R")
        os.close(3)
    except OSError:
        pass  # started by hand, not by bunshin-init
    while True:
        conn, _ = server.accept()
        threading.Thread(target=agent.serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
