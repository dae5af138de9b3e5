"""envd's services on a workspace: commands (``process.Process``) and files (``filesystem.Filesystem``, ``/files``).

Commands. ``Start`` spawns the command (``ws.spawn``) through a small ``sh`` wrapper that sends its stdout and stderr to
two files in the command's control directory (``CONTROL_DIR/p/N.<random>``, private to its user) and its stdin from a
FIFO there, held open for writing by a holder process while the command runs, so that the command sees no end of
file between two ``send_stdin`` calls until ``CloseStdin`` ends the holder. A pump
task per command (while someone listens) polls the process (``BackgroundProcess.poll``) and reads what the files gained
since the last look with the agent's file tool (``ws.read_file``; the control directory is the workspace's workdir, the
file tools' confinement root), every 1 ms while output flows, backing off to 50 ms while it is quiet, and fans the
chunks out to the streams listening (the ``Start`` stream and ``Connect`` streams). Output therefore arrives as it is
produced, a poll interval late. ``SendInput`` writes to the FIFO from a command in the workspace (``ws.exec``),
``SendSignal`` signals the process group (``BackgroundProcess.signal``). The start stream's deadline (the SDK's
``timeout``, 60 s by default) kills the command, as envd does.

Files go through commands in the workspace too (``ws.exec`` of coreutils and findutils), whatever the path: the
host never resolves a path inside the workspace, and E2B paths lie anywhere in the tree while the file tools are
confined to one directory. ``watch_dir`` compares the directory's listing every ``WATCH_INTERVAL`` (create,
write, remove; a rename is a remove and a create). Reads come back base64-encoded (the exec result is text) and are
bounded by ``MAX_READ``; uploads by ``MAX_UPLOAD``, written in pieces of ``UPLOAD_CHUNK`` as they arrive, under
temporary names renamed over their targets only when the whole upload arrived (``Upload``).
PTY sessions are refused (``unimplemented``): the agent gives commands no terminal.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import posixpath
import re
import secrets
import signal as _signal
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream

from .._exceptions import BunshinError, FileNotFound, InvalidArgument, PathOutsideWorkspace, ToolTimeout
from .._host._protocol import ExecResult
from ._backends import Handle
from ._sandboxes import CONTROL_DIR, HOME, MAX_OUTPUT, Process, Sandbox, end_subscribers
from ._wire import (
    EntryInfo,
    ListResponse,
    OutConfig,
    ProcessConfig,
    ProcessInfo,
    ProcessSelector,
    RpcError,
    StartRequest,
    data_event,
    end_event,
)

MAX_READ = (MAX_OUTPUT // 4) * 3 - 4096
"""Largest file ``files.read`` returns (its base64 must fit a command's output cap)."""
MAX_UPLOAD = 64 << 20
"""Largest request body of an upload (all files of it)."""
UPLOAD_CHUNK = 4 << 20
"""Bytes of an upload the server holds at once: a larger file reaches the workspace in pieces (a command each)."""
CHUNK = 256 << 10
"""Most bytes of one stream a pump reads per look (one event)."""
BUFFERED = 16
"""Events a listener may have waiting."""
SLOW_LISTENER = 30.0
_FIRST_LOOK, _QUIET_LOOK = 0.001, 0.05
"""A pump looks again after 1 ms while output flows, backing off by half each quiet look to 50 ms (a look is three
agent calls of ~0.2 ms: poll and two reads)."""
_TAIL_FROM = 4 << 20
"""Past this offset a pump reads with ``tail`` (the file tool reads from the start)."""
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?|[0-9]{1,10}")
_NOT_FOUND, _EXISTS, _TOO_BIG, _NOT_DIR, _IS_DIR = 44, 45, 46, 47, 48


def user_from(authorization: str | None) -> str | None:
    """The user of an envd request (``Authorization: Basic base64("user:")``), None for the workspace's default."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        raise RpcError("Authorization must be Basic", code="invalid_argument")
    try:
        user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (ValueError, UnicodeDecodeError) as exc:
        raise RpcError("malformed Authorization header", code="invalid_argument") from exc
    if not user:
        return None
    if not _USER.fullmatch(user):
        raise RpcError(f"invalid user name {user!r}", code="invalid_argument")
    return user


def absolute(path: str) -> str:
    """E2B resolves relative paths (and ``~``) against the user's home."""
    if not path or "\0" in path or len(path) > 4096:
        raise RpcError(f"invalid path {path[:100]!r}", code="invalid_argument")
    if path == "~" or path.startswith("~/"):
        path = HOME + path[1:]
    if not path.startswith("/"):
        path = f"{HOME}/{path}"
    return posixpath.normpath(path).replace("//", "/")


def _tool_error(exc: BunshinError) -> RpcError:
    if isinstance(exc, FileNotFound):
        return RpcError(str(exc), code="not_found")
    if isinstance(exc, (InvalidArgument, PathOutsideWorkspace)):
        return RpcError(str(exc), code="invalid_argument")
    if isinstance(exc, ToolTimeout):
        return RpcError(str(exc), code="deadline_exceeded")
    return RpcError(str(exc), code="unavailable" if getattr(exc, "workspace_id", None) else "internal")


async def _run(
    ws: Handle, script: str, *args: str, user: str | None, stdin: bytes | None = None, timeout: float = 60
) -> ExecResult:
    """Run ``sh -c script`` with ``args`` in the workspace; the exit codes of the helpers map onto Connect codes."""
    try:
        res = await ws.exec(["/bin/sh", "-c", script, "sh", *args], stdin=stdin, timeout=timeout, user=user, cwd="/")
    except BunshinError as exc:
        raise _tool_error(exc) from exc
    message = res.stderr.strip()[-500:] or f"exit status {res.exit_code}"
    codes = {
        _NOT_FOUND: "not_found",
        _EXISTS: "already_exists",
        _TOO_BIG: "resource_exhausted",
        _NOT_DIR: "invalid_argument",
        _IS_DIR: "invalid_argument",
    }
    if res.exit_code in codes:
        raise RpcError(message, code=codes[res.exit_code])
    if res.exit_code != 0:
        raise RpcError(message, code="internal" if res.exit_code != 1 else "permission_denied")
    if res.truncated:
        raise RpcError("the answer was larger than this server reads", code="resource_exhausted")
    return res


# ------------------------------------------------------------------------------------------------ files

_EXISTS_CHECK = f'[ -e "$1" ] || [ -L "$1" ] || {{ echo "no such file or directory: $1" >&2; exit {_NOT_FOUND}; }}'
# find -printf: type, type followed, size, octal mode, symbolic mode, user, group, mtime, link target, path.
_PRINTF = r"%y\0%Y\0%s\0%m\0%M\0%u\0%g\0%T@\0%l\0%p\0"
_KINDS = {"f": "FILE_TYPE_FILE", "d": "FILE_TYPE_DIRECTORY"}


def _entries(out: str) -> list[EntryInfo]:
    # No field holds a NUL, so records are every 10 NUL-separated fields (a field may hold, or start with, a newline).
    fields = out.split("\0")
    entries = []
    for i in range(0, len(fields) - 9, 10):
        kind, target_kind, size, mode, perms, owner, group, mtime, target, path = fields[i : i + 10]
        is_link = kind == "l"
        ftype = _KINDS.get(target_kind if is_link else kind, "FILE_TYPE_UNSPECIFIED" if not is_link else "")
        if not ftype:  # a dangling symlink: E2B's old envd said SYMLINK
            ftype = "FILE_TYPE_SYMLINK"
        try:
            stamp = datetime.datetime.fromtimestamp(float(mtime), datetime.timezone.utc)
        except (ValueError, OverflowError, OSError):  # what a workspace's find printed is not trusted
            stamp = datetime.datetime.fromtimestamp(0, datetime.timezone.utc)
        entries.append(
            EntryInfo(
                name=posixpath.basename(path) or "/",
                type=ftype,
                path=path,
                size=size if size.isascii() and size.isdigit() else "0",
                mode=int(mode, 8) if re.fullmatch(r"[0-7]{1,7}", mode) else 0,
                permissions=perms,
                owner=owner,
                group=group,
                modified_time=stamp.isoformat().replace("+00:00", "Z"),
                symlink_target=target if is_link else None,
                is_symlink=is_link,
            )
        )
    return entries


async def stat(ws: Handle, path: str, user: str | None) -> EntryInfo:
    path = absolute(path)
    res = await _run(ws, f'{_EXISTS_CHECK}; find "$1" -maxdepth 0 -printf "$2"', path, _PRINTF, user=user)
    entries = _entries(res.stdout)
    if not entries:
        raise RpcError(f"cannot stat {path}", code="internal")
    return entries[0]


async def list_dir(ws: Handle, path: str, depth: int, user: str | None) -> list[EntryInfo]:
    path = absolute(path)
    depth = max(1, min(depth or 1, 64))
    script = (
        f'{_EXISTS_CHECK}; [ -d "$1" ] || {{ echo "$1 is not a directory" >&2; exit {_NOT_DIR}; }}; '
        'find "$1" -mindepth 1 -maxdepth "$3" -printf "$2"'
    )
    res = await _run(ws, script, path, _PRINTF, str(depth), user=user)
    return _entries(res.stdout)


async def make_dir(ws: Handle, path: str, user: str | None) -> EntryInfo:
    path = absolute(path)
    script = f'[ -e "$1" ] && {{ echo "$1 already exists" >&2; exit {_EXISTS}; }}; mkdir -p -- "$1"'
    await _run(ws, script, path, user=user)
    return await stat(ws, path, user)


async def move(ws: Handle, source: str, destination: str, user: str | None) -> EntryInfo:
    source, destination = absolute(source), absolute(destination)
    await _run(ws, f'{_EXISTS_CHECK}; mv -T -- "$1" "$2"', source, destination, user=user)
    return await stat(ws, destination, user)


async def remove(ws: Handle, path: str, user: str | None) -> None:
    await _run(ws, f'{_EXISTS_CHECK}; rm -rf -- "$1"', absolute(path), user=user)


async def read(ws: Handle, path: str, user: str | None) -> bytes:
    script = (
        f'{_EXISTS_CHECK}; [ -d "$1" ] && {{ echo "$1 is a directory" >&2; exit {_IS_DIR}; }}; '
        f'[ "$(stat -L -c %s -- "$1")" -le "$2" ] || {{ echo "$1 is larger than $2 bytes" >&2; exit {_TOO_BIG}; }}; '
        'base64 -w0 -- "$1"'
    )
    res = await _run(ws, script, absolute(path), str(MAX_READ), user=user)
    try:
        return base64.b64decode(res.stdout, validate=True)
    except ValueError as exc:  # what the workspace's base64 printed is not trusted
        raise RpcError(f"unreadable answer reading {path[:100]!r}: {exc}", code="data_loss") from exc


# An upload stages each file in a directory of its own beside the target (``.bunshin-upload-<random>``, made by the
# request's user, mode 700), as a file of the same random name inside it. Every later step first enters that
# directory (``cd -P``) and checks it is still one only the request's user can change (``_ENTER``): the path lies in
# a directory a process of another user may own, which can rename what the upload made there and put a symlink in
# its place; from inside a directory of its own, the upload's file names resolve against that directory, not the
# path, and nobody else can swap the file (a symlink to another of the user's mode-700 directories only moves the
# random-named file there, which nothing else has).
_ENTER = 'cd -P -- "$1" 2>/dev/null && [ "$(stat -c %u:%a .)" = "$(id -u):700" ] && n=${1##*/}'
_STAGE = (
    f'p=$1 t=$2; [ -d "$p" ] && {{ echo "$p is a directory" >&2; exit {_IS_DIR}; }}; '
    # the topmost directory this upload makes (printed: removed again, if empty, when the upload fails)
    'd=${t%/*}; n=$d; m=; while [ -n "$n" ] && [ ! -e "$n" ] && [ ! -L "$n" ]; do m=$n; n=${n%/*}; done; '
    'mkdir -p -- "$d/" && mkdir -m 700 -- "$t" && set -- "$t" && '
    f'{{ {_ENTER} || {{ echo "the upload\'s directory $1 was replaced" >&2; exit 1; }}; }} && : >"$n" && printf %s "$m"'
)
_APPEND = f'{{ {_ENTER} || {{ echo "the upload\'s directory $1 was replaced" >&2; exit 1; }}; }} && cat >>"$n"'
# Each pair (staging directory, target): keep an existing regular file's permission bits (not its set-id or sticky
# bits: the file is the request user's now, and the target's mode is whatever its directory's owner made it), then
# rename the staged file over the target (mv -T: never into a directory of that name) and remove the directory.
_COMMIT = (
    f'while [ $# -gt 1 ]; do {{ {_ENTER} || {{ echo "the upload\'s directory $1 was replaced" >&2; exit 1; }}; }}; '
    'if [ -f "$2" ] && [ ! -L "$2" ]; then m=$(stat -c %a -- "$2") && '
    'chmod "$(printf %o "$((0$m & 0777))")" -- "$n" || exit; fi; '
    'mv -f -T -- "$n" "$2" || exit; cd / && rmdir -- "$1" 2>/dev/null; shift 2; done; true'
)
# Each pair (staging directory, topmost directory made or empty): remove the staged file (from inside its directory
# only: rm -rf of the path could be made to remove another tree), the directory, then the directories made, while
# empty.
_DISCARD = (
    f'while [ $# -gt 1 ]; do if {_ENTER}; then rm -f -- "$n"; fi; cd / && rmdir -- "$1" 2>/dev/null; '
    'if [ -n "$2" ]; then d=${1%/*}; '
    'while rmdir -- "$d" 2>/dev/null && [ "$d" != "$2" ]; do d=${d%/*}; done; fi; shift 2; done; true'
)
_DISCARD_BOUND = 30.0
"""Longest the removal of a failed upload's files may take (it runs shielded, after a cancellation too)."""


class Upload:
    """The files of one upload request, all of them or none. Each is written, as it arrives, under a temporary name
    beside its target (in ``.bunshin-upload-<random>/``, a directory of the request's user only, in the same
    directory, ``_ENTER``); ``commit`` renames them over their targets once every file arrived whole (a symlink at a
    target is replaced, not written through; an existing file's permission bits are kept, not its set-id bits, and
    its owner becomes the request's user, as E2B's envd makes it). Leaving the ``async with`` otherwise (a body past
    the limit, a workspace error, a cancellation, a client gone) removes what was written and the directories the
    upload made, shielded. Every step is a command in the workspace: the host resolves no path there."""

    def __init__(self, ws: Handle, user: str | None) -> None:
        self.ws = ws
        self.user = user
        self._staged: list[tuple[str, str, str]] = []  # (target, staging directory, topmost directory made or "")

    async def __aenter__(self) -> Upload:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        staged, self._staged = self._staged, []
        if staged:
            with anyio.move_on_after(_DISCARD_BOUND, shield=True), contextlib.suppress(RpcError):
                await _run(self.ws, _DISCARD, *[a for _, temp, made in staged for a in (temp, made)], user=self.user)

    async def add(self, path: str, data: AsyncIterator[bytes]) -> dict[str, str]:
        """Stage ``data`` for ``path`` (parents made as needed); E2B's WriteInfo of it. At most ``UPLOAD_CHUNK``
        bytes (and one piece of ``data``) are held at once: each such piece is appended to the staged file."""
        path = absolute(path)
        temp = f"{posixpath.dirname(path).rstrip('/')}/.bunshin-upload-{secrets.token_hex(8)}"
        self._staged.append((path, temp, ""))
        made = (await _run(self.ws, _STAGE, path, temp, user=self.user)).stdout
        if made and (temp.startswith(made + "/")):  # what the workspace printed is checked, not trusted
            self._staged[-1] = (path, temp, made)
        pending = bytearray()
        async for piece in data:
            pending += piece
            if len(pending) >= UPLOAD_CHUNK:
                await _run(self.ws, _APPEND, temp, stdin=bytes(pending), user=self.user, timeout=300)
                pending.clear()
        if pending:
            await _run(self.ws, _APPEND, temp, stdin=bytes(pending), user=self.user, timeout=300)
        return {"name": posixpath.basename(path), "type": "file", "path": path}

    async def commit(self) -> None:
        """Rename every staged file over its target (one command); what is not renamed is removed on exit."""
        if self._staged:
            await _run(self.ws, _COMMIT, *[a for path, temp, _ in self._staged for a in (temp, path)], user=self.user)
            self._staged = []


WATCH_INTERVAL = 0.2
"""How often a directory watch looks at the directory (seconds)."""
MAX_WATCHED = 100_000
"""Most entries a watch follows; a larger tree ends the watch with ``resource_exhausted``."""


async def watch_state(ws: Handle, path: str, recursive: bool, user: str | None) -> dict[str, str]:
    """Every entry below ``path`` (relative name -> type, size and mtime): what a watch compares between looks."""
    script = (
        f'{_EXISTS_CHECK}; [ -d "$1" ] || {{ echo "$1 is not a directory" >&2; exit {_NOT_DIR}; }}; '
        'find "$1" -mindepth 1 $2 -printf "%P\\0%y %s %T@\\0"'
    )
    res = await _run(ws, script, path, "" if recursive else "-maxdepth 1", user=user)
    fields = res.stdout.split("\0")
    if len(fields) > 2 * MAX_WATCHED:
        raise RpcError(f"{path} holds more than {MAX_WATCHED} entries to watch", code="resource_exhausted")
    return dict(zip(fields[0::2], fields[1::2], strict=False))  # a trailing empty field


def watch_events(before: dict[str, str], after: dict[str, str]) -> list[dict[str, Any]]:
    """E2B's filesystem events between two looks: created, removed, written (size or mtime changed)."""
    out = [{"filesystem": {"name": n, "type": "EVENT_TYPE_CREATE"}} for n in after if n not in before]
    out += [{"filesystem": {"name": n, "type": "EVENT_TYPE_REMOVE"}} for n in before if n not in after]
    out += [
        {"filesystem": {"name": n, "type": "EVENT_TYPE_WRITE"}}
        for n, v in after.items()
        if n in before and before[n] != v and not v.startswith("d")
    ]
    return out


# ------------------------------------------------------------------------------------------------ commands

# With stdin, a holder (a subshell in the command's process group) keeps the FIFO open for writing while the
# command runs, so that the command sees no end of file between two ``send_stdin`` calls; ``close_stdin`` ends the
# holder (its pid is in ``hold``) and the command reads to an end of file. The holder leaves within a second of the
# command (it looks with ``kill -0``). The command's end is opened (fd 3, waiting for the holder's: fifo(7)) before
# ``hold`` names the holder: a holder ended before that open left the command's open waiting for a writer forever,
# and what ``send_stdin`` had written was dropped with the pipe.
_WRAPPER = (
    'd=$1 s=$2; shift 2; mkdir -p "${d%/*}" && mkdir -m 700 "$d" && : >"$d/out" && : >"$d/err" || exit 126; '
    'if [ "$s" = 1 ]; then mkfifo "$d/in" || exit 126; p=$$; '
    '(while kill -0 "$p" 2>/dev/null; do sleep 1 </dev/null; done) <>"$d/in" >/dev/null 2>&1 & '
    'h=$!; exec 3<"$d/in" || exit 126; '
    'echo $h >"$d/hold" && exec "$@" <&3 3<&- >"$d/out" 2>"$d/err"; exit 126; fi; '
    'exec "$@" </dev/null >"$d/out" 2>"$d/err"'
)


def find_process(sb: Sandbox, selector: ProcessSelector) -> Process:
    for proc in sb.processes.values():
        if (selector.pid is not None and proc.pid == selector.pid) or (
            selector.tag is not None and proc.tag == selector.tag
        ):
            return proc
    raise RpcError(f"process {selector.pid if selector.pid is not None else selector.tag} not found", code="not_found")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")


def check_config(cfg: ProcessConfig) -> None:
    """A command as a client sends it: a command, arguments without NUL, environment names a shell would take."""
    if not cfg.cmd:
        raise RpcError("process.cmd is empty", code="invalid_argument")
    if any("\0" in a for a in [cfg.cmd, *cfg.args, *cfg.envs.values()]):
        raise RpcError("a command, argument or environment value contains NUL", code="invalid_argument")
    bad = next((k for k in cfg.envs if not _ENV_NAME.fullmatch(k)), None)
    if bad is not None:
        raise RpcError(f"invalid environment variable name {bad[:100]!r}", code="invalid_argument")


async def start(sb: Sandbox, req: StartRequest, user: str | None) -> Process:
    if req.pty is not None:
        raise RpcError(
            "PTY sessions are not served by bunshin e2b (a workspace's commands run without a terminal): use "
            "commands.run, with stdin=True to feed one",
            code="unimplemented",
        )
    cfg = req.process
    check_config(cfg)
    ws = sb.workspace()
    n = sb.next_process
    sb.next_process += 1
    # Unguessable and made afresh by the command's user (CONTROL_DIR/p is sticky, writable by all, not listable): a
    # process in the workspace cannot plant the files of a command to come (its output, its stdin FIFO).
    rel = f"p/{n}.{secrets.token_hex(8)}"
    argv = ["/bin/sh", "-c", _WRAPPER, "sh", f"{CONTROL_DIR}/{rel}", "1" if req.stdin else "0", cfg.cmd, *cfg.args]
    cwd = absolute(cfg.cwd) if cfg.cwd else sb.cwd
    try:
        pid = await ws.spawn(argv, cwd=cwd, env=cfg.envs or None, user=user)
    except BunshinError as exc:
        raise _tool_error(exc) from exc
    proc = Process(pid, rel, cfg.cmd, list(cfg.args), dict(cfg.envs), cfg.cwd, req.tag, bool(req.stdin), user=user)
    sb.processes[proc.pid] = proc
    return proc


async def running(sb: Sandbox) -> ListResponse:
    ws = sb.workspace()
    out = []
    for proc in list(sb.processes.values()):
        if proc.exit_code is None:
            try:
                code = await ws.poll(proc.pid)
            except BunshinError as exc:
                raise _tool_error(exc) from exc
            if code is not None and not proc.pumping:  # a pump finishes what it streams
                await finished(sb, proc, code)
        if proc.exit_code is None:
            config = OutConfig(cmd=proc.cmd, args=proc.args, envs=proc.envs, cwd=proc.cwd)
            out.append(ProcessInfo(config=config, pid=proc.pid, tag=proc.tag))
    return ListResponse(processes=out)


async def send_input(sb: Sandbox, proc: Process, data: bytes) -> None:
    if not proc.stdin:
        raise RpcError(f"process {proc.pid} was started without stdin", code="failed_precondition")
    if proc.stdin_closed:
        raise RpcError(f"the stdin of process {proc.pid} was closed", code="failed_precondition")
    ws = sb.workspace()
    # The wrapper may not have made the FIFO yet (Start answers once the process exists): wait for it, never create
    # it. Open it write-only, which waits for a reader (fifo(7)): the command or, while it runs, its holder.
    script = (
        'i=0; while [ ! -p "$1" ]; do i=$((i+1)); '
        f'[ $i -gt 1000 ] && {{ echo "no stdin pipe for process $2" >&2; exit {_NOT_FOUND}; }}; sleep 0.01; done; '
        'cat > "$1"'
    )
    # As the command's user: its control directory is its own, and root must not follow what it may have planted.
    await _run(ws, script, f"{CONTROL_DIR}/{proc.dir}/in", str(proc.pid), stdin=data, user=proc.user, timeout=15)


async def close_stdin(sb: Sandbox, proc: Process) -> None:
    """End the command's stdin: its holder goes, so once the last ``send_stdin`` is written the command reads an
    end of file."""
    if not proc.stdin:
        raise RpcError(f"process {proc.pid} was started without stdin", code="failed_precondition")
    if proc.exit_code is not None:
        raise RpcError(f"process {proc.pid} has exited", code="not_found")
    script = (
        'i=0; while [ ! -s "$1" ]; do i=$((i+1)); '
        f'[ $i -gt 1000 ] && {{ echo "no stdin holder for process $2" >&2; exit {_NOT_FOUND}; }}; sleep 0.01; done; '
        'read -r h <"$1" && case $h in *[!0-9]*|"") exit 1;; esac && kill "$h" 2>/dev/null; true'
    )
    # As the command's user, like send_input: the holder is its own process, the control directory its own.
    await _run(sb.workspace(), script, f"{CONTROL_DIR}/{proc.dir}/hold", str(proc.pid), user=proc.user, timeout=15)
    proc.stdin_closed = True


async def send_signal(sb: Sandbox, proc: Process, signal: str | int) -> None:
    names = {"SIGNAL_SIGKILL": _signal.SIGKILL, "SIGNAL_SIGTERM": _signal.SIGTERM, 9: 9, 15: 15}
    sig = names.get(signal)
    if sig is None:
        raise RpcError(f"unsupported signal {signal!r}", code="invalid_argument")
    if proc.exit_code is not None:
        raise RpcError(f"process {proc.pid} has exited", code="not_found")
    try:
        await sb.workspace().signal(proc.pid, int(sig))
    except BunshinError as exc:
        raise _tool_error(exc) from exc


_READ_BOUND = 10.0
"""Longest a pump waits for one read of a command's output: the command owns its control directory and may swap
its output file for a FIFO nobody writes, which an open waits on."""


async def _read_delta(ws: Handle, path: str, offset: int, user: str | None) -> bytes:
    try:
        with anyio.fail_after(_READ_BOUND):
            if offset < _TAIL_FROM:
                return (await ws.read_file(path, max_bytes=offset + CHUNK))[offset:]
            script = 'tail -c +"$2" -- "$1" | head -c "$3" | base64 -w0'
            argv = ["/bin/sh", "-c", script, "sh", f"{CONTROL_DIR}/{path}", str(offset + 1), str(CHUNK)]
            res = await ws.exec(argv, user=user, timeout=_READ_BOUND)
        return base64.b64decode(res.stdout)[:CHUNK]
    except FileNotFound:  # the wrapper has not made it yet
        return b""
    except TimeoutError as exc:
        raise RpcError(f"the output of a command was not readable within {_READ_BOUND} s", code="data_loss") from exc
    except ValueError as exc:  # not base64: what the workspace's tools printed is not trusted
        raise RpcError(f"unreadable output of a command: {exc}", code="data_loss") from exc


async def broadcast(proc: Process, message: dict[str, Any]) -> None:
    """Send to every listener, waiting while one's buffer is full (the pump, and so the reading of the command's
    output, slows to the pace of its listeners: memory stays bounded by ``BUFFERED`` chunks each); a listener that
    takes no message for ``SLOW_LISTENER`` seconds is dropped, its stream ends in an error."""
    for send in list(proc.subscribers):
        try:
            with anyio.fail_after(SLOW_LISTENER):
                await send.send(message)
        except (TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            if send in proc.subscribers:
                proc.subscribers.remove(send)
            send.close()


def _listened(proc: Process) -> bool:
    """Whether a stream still listens to ``proc``: a subscriber whose stream ended (its client gone) is dropped."""
    for send in [s for s in proc.subscribers if not s.statistics().open_receive_streams]:
        proc.subscribers.remove(send)
        send.close()
    return bool(proc.subscribers)


async def pump(sb: Sandbox, proc: Process) -> None:
    """Stream the process's output to its listeners until it exits, the last listener leaves or the workspace goes."""
    proc.pumping = True
    interval = _FIRST_LOOK
    try:
        ws = sb.workspace()
        while _listened(proc):
            code = await ws.poll(proc.pid)
            got = False
            for stream, name in (("stdout", "out"), ("stderr", "err")):
                data = await _read_delta(ws, f"{proc.dir}/{name}", proc.offsets[stream], proc.user)
                if data:
                    proc.offsets[stream] += len(data)
                    await broadcast(proc, data_event(stream, data))
                    got = True
            if code is not None and not got:
                await broadcast(proc, end_event(code))
                end_subscribers(proc, None)
                with anyio.CancelScope(shield=True):
                    await finished(sb, proc, code)
                return
            interval = _FIRST_LOOK if got else min(interval * 1.5, _QUIET_LOOK)
            await anyio.sleep(interval)
    except BunshinError as exc:
        proc.lost = str(exc)
        end_subscribers(proc, None)
    finally:
        proc.pumping = False


KEEP_EXITED = 256
"""Exited commands a sandbox remembers (for ``Connect`` to report their exit code); older records are dropped."""


async def finished(sb: Sandbox, proc: Process, code: int) -> None:
    """The command exited and its output was streamed (or nobody listened): record the code, remove its control
    directory (a sandbox running thousands of commands must not keep their output) and old records."""
    proc.exit_code = code
    exited = [pid for pid, p in sb.processes.items() if p.exit_code is not None]
    for pid in exited[:-KEEP_EXITED]:
        del sb.processes[pid]
    try:
        await sb.workspace().exec(["rm", "-rf", "--", f"{CONTROL_DIR}/{proc.dir}"], timeout=30)
    except BunshinError:
        pass  # the sandbox is going away: so is the directory


def listen(tg: TaskGroup, sb: Sandbox, proc: Process) -> MemoryObjectReceiveStream[dict[str, Any] | None]:
    """A stream of the process's events from now on (data, then end); starts the pump if none runs."""
    send, receive = anyio.create_memory_object_stream[dict[str, Any] | None](BUFFERED)
    if proc.exit_code is not None:
        send.send_nowait(end_event(proc.exit_code))
        send.close()
        return receive
    proc.subscribers.append(send)
    if not proc.pumping:
        tg.start_soon(pump, sb, proc)
    return receive
