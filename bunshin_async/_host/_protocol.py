"""Messages between the host and the agent inside a workspace: the one definition of the protocol.

Frames on the agent socket are a 4-byte big-endian length and a msgpack body (msgspec's encoding: a Struct is a map
tagged by "op" or "kind", bytes are bin, an optional field is absent or nil). The agent (native/agent.c, a static C
program) decodes exactly these shapes and answers anything else with ``Failure(error="protocol")``; a change here
needs the same change there and a new ``PROTOCOL_VERSION``.
"""

from __future__ import annotations

import msgspec

#: Bumped whenever a message changes shape; the agent refuses a host that speaks another version.
#: 2: the C agent (``user`` on Exec, Spawn and ShellOpen; ``shell`` on Pong, ShellOpened and ExecResult).
PROTOCOL_VERSION = 2
DEFAULT_MAX_OUTPUT = 1 << 20
#: Largest request frame the agent reads (agent.c MAX_REQUEST); it answers a larger one with a protocol Failure.
MAX_REQUEST = 256 << 20


class Request(msgspec.Struct, tag_field="op", frozen=True, forbid_unknown_fields=True):
    """Base of every request."""


class Ping(Request, tag="ping", frozen=True):
    version: int = PROTOCOL_VERSION


class Exec(Request, tag="exec", frozen=True):
    """Run ``argv`` (or ``command`` through /bin/bash, or /bin/sh where the image has no bash) to completion in a
    new session. ``user`` is ``NAME``, ``UID``, or either with ``:GROUP``/``:GID``, resolved from the image's
    /etc/passwd and /etc/group; None runs as the workspace's root."""

    argv: list[str] | None = None
    command: str | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: bytes | None = None
    timeout: float | None = None
    max_output: int = DEFAULT_MAX_OUTPUT
    user: str | None = None


class ShellOpen(Request, tag="shell_open", frozen=True):
    cwd: str | None = None
    env: dict[str, str] | None = None
    user: str | None = None


class ShellRun(Request, tag="shell_run", frozen=True):
    shell_id: int
    command: str
    timeout: float | None = None
    max_output: int = DEFAULT_MAX_OUTPUT


class ShellClose(Request, tag="shell_close", frozen=True):
    shell_id: int


class ReadFile(Request, tag="read_file", frozen=True):
    path: str
    max_bytes: int | None = None


class WriteFile(Request, tag="write_file", frozen=True):
    path: str
    data: bytes
    append: bool = False
    mode: int | None = None
    make_parents: bool = True


class ListDir(Request, tag="list_dir", frozen=True):
    path: str


class Remove(Request, tag="remove", frozen=True):
    path: str
    recursive: bool = False


class Spawn(Request, tag="spawn", frozen=True):
    """Start a background process that outlives the call; its output goes to ``log_path`` (or /dev/null)."""

    argv: list[str] | None = None
    command: str | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    log_path: str | None = None
    user: str | None = None


class Signal(Request, tag="signal", frozen=True):
    pid: int
    signal: int


class Poll(Request, tag="poll", frozen=True):
    """Ask whether a background process still runs; ``returncode`` is None while it does."""

    pid: int


AnyRequest = (
    Ping | Exec | ShellOpen | ShellRun | ShellClose | ReadFile | WriteFile | ListDir | Remove | Spawn | Signal | Poll
)


class Response(msgspec.Struct, tag_field="kind", frozen=True):
    """Base of every response."""


class Pong(Response, tag="pong", frozen=True):
    version: int
    pid: int
    shell: str | None = None  # what command strings run through: /bin/bash, /bin/sh, or None (no shell)
    waiting: int = 0  # calls queued behind another command of their shell session (waiting for its lock)


class Ok(Response, tag="ok", frozen=True):
    pass


class ExecResult(Response, tag="exec_result", frozen=True):
    """Outcome of a finished command. Output is decoded as UTF-8 with replacement; ``truncated`` says a stream
    went past ``max_output`` bytes, the rest being read and dropped. ``shell`` is the shell a command string or a
    shell session ran through (/bin/bash, or /bin/sh where the image has no bash); None for an argv."""

    exit_code: int
    stdout: str
    stderr: str
    duration: float
    truncated: bool = False
    shell: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class FileData(Response, tag="file_data", frozen=True):
    data: bytes
    truncated: bool = False


class DirEntry(msgspec.Struct, frozen=True):
    """One entry of ``Workspace.list_dir``."""

    name: str
    kind: str  # "file", "dir", "symlink" or "other"
    size: int


class DirListing(Response, tag="dir_listing", frozen=True):
    entries: list[DirEntry]


class ShellOpened(Response, tag="shell_opened", frozen=True):
    shell_id: int
    shell: str | None = None


class Spawned(Response, tag="spawned", frozen=True):
    pid: int


class PollResult(Response, tag="poll_result", frozen=True):
    returncode: int | None


class Failure(Response, tag="failure", frozen=True):
    """A request failed. ``error`` is one of ERROR_KINDS; the host maps it onto its exception tree."""

    error: str
    message: str
    path: str | None = None
    stdout: str = ""
    stderr: str = ""


ERROR_KINDS = ("timeout", "path_outside", "not_found", "invalid", "os", "protocol", "internal", "name_too_long")

AnyResponse = Pong | Ok | ExecResult | FileData | DirListing | ShellOpened | Spawned | PollResult | Failure

request_encoder = msgspec.msgpack.Encoder()
response_encoder = request_encoder
request_decoder = msgspec.msgpack.Decoder(AnyRequest)
response_decoder = msgspec.msgpack.Decoder(AnyResponse)
