"""The JSON shapes of E2B's control plane and of envd's Connect services, and Connect's framing.

Field names and types follow the SDK's OpenAPI models (``e2b/api/client/models``) and the envd protobufs
(``process/process.proto``, ``filesystem/filesystem.proto``) in proto3's canonical JSON: camelCase names, bytes in
base64, int64 as a string, enums by name, default values left out. Only what the SDK sends or reads is modelled;
unknown request fields are ignored, as a newer SDK may send more.

Connect (https://connectrpc.com/docs/protocol): a unary call is a POST of ``application/json`` answered by the
message or, on error, by an HTTP status and ``{"code", "message"}``. A server stream is a POST of
``application/connect+json`` whose body and answer are envelopes: one flags byte, a 4-byte big-endian length, the
message; the last envelope has flag 0x02 and carries ``{}`` or ``{"error": {...}}``.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from .._exceptions import BunshinError

ENVD_VERSION = "0.5.7"
"""The envd version sandboxes report: the SDK turns features on by it. 0.5.7 brings octet-stream uploads; what lies
above (file metadata 0.6.2, watch entries 0.6.3) the SDK refuses itself with a clear TemplateException."""

# ------------------------------------------------------------------------------------------------ Connect errors

#: Connect error code -> HTTP status of a unary error (the protocol's table).
HTTP_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class RpcError(BunshinError):
    """An envd call failed with a Connect ``code``; the SDK maps the code onto its own exceptions (not_found ->
    NotFoundException/FileNotFoundException, deadline_exceeded -> TimeoutException, ...)."""

    code: str

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message, code=code)


class ApiError(BunshinError):
    """A control-plane request failed with HTTP ``status``; the body is E2B's ``{"code", "message"}``."""

    status: int

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message, status=status)


# ------------------------------------------------------------------------------------------------ framing

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
MAX_MESSAGE = 1 << 20
"""Largest request message of an envd stream (a StartRequest: a command, its env); a larger one is refused."""


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def end_stream(error: RpcError | None = None) -> bytes:
    body: dict[str, Any] = {} if error is None else {"error": {"code": error.code, "message": error.message}}
    return envelope(msgspec.json.encode(body), FLAG_END_STREAM)


def unenvelope(body: bytes) -> bytes:
    """The one message of a server-stream request body (bounded by the caller); RpcError if malformed."""
    if len(body) < 5:
        raise RpcError("stream request without an envelope", code="invalid_argument")
    flags, length = struct.unpack(">BI", body[:5])
    if flags & FLAG_COMPRESSED:
        raise RpcError("compressed messages are not supported", code="unimplemented")
    if length != len(body) - 5 or length > MAX_MESSAGE:
        raise RpcError("stream request envelope length does not match its body", code="invalid_argument")
    return body[5:]


def error_body(code: str, message: str) -> bytes:
    return msgspec.json.encode({"code": code, "message": message})


# ------------------------------------------------------------------------------------------------ envd: process


class _In(msgspec.Struct, rename="camel", omit_defaults=True):
    """A request message: unknown fields ignored, every field optional as in proto3."""


class _Out(msgspec.Struct, rename="camel", omit_defaults=True):
    """A response message: default values left out, as proto3 JSON does."""


class ProcessConfig(_In):
    cmd: str = ""
    args: list[str] = []
    envs: dict[str, str] = {}
    cwd: str | None = None


class ProcessSelector(_In):
    pid: int | None = None
    tag: str | None = None


class StartRequest(_In):
    process: ProcessConfig = msgspec.field(default_factory=ProcessConfig)
    pty: dict[str, Any] | None = None
    tag: str | None = None
    stdin: bool | None = None


class ConnectRequest(_In):
    process: ProcessSelector = msgspec.field(default_factory=ProcessSelector)


class ProcessInput(_In):
    stdin: bytes | None = None
    pty: bytes | None = None


class SendInputRequest(_In):
    process: ProcessSelector = msgspec.field(default_factory=ProcessSelector)
    input: ProcessInput = msgspec.field(default_factory=ProcessInput)


class SendSignalRequest(_In):
    process: ProcessSelector = msgspec.field(default_factory=ProcessSelector)
    signal: str | int = 0


class SelectRequest(_In):
    """CloseStdin and Update: a process selector (Update's PTY size is not served)."""

    process: ProcessSelector = msgspec.field(default_factory=ProcessSelector)


class OutConfig(_Out):
    cmd: str = ""
    args: list[str] = []
    envs: dict[str, str] = {}
    cwd: str | None = None


class ProcessInfo(_Out):
    config: OutConfig
    pid: int
    tag: str | None = None


class ListResponse(_Out):
    processes: list[ProcessInfo] = []


def start_event(pid: int) -> dict[str, Any]:
    return {"event": {"start": {"pid": pid}}}


def data_event(stream: str, chunk: bytes) -> dict[str, Any]:
    return {"event": {"data": {stream: chunk}}}


def end_event(exit_code: int) -> dict[str, Any]:
    end: dict[str, Any] = {"exited": True, "status": f"exit status {exit_code}"}
    if exit_code:
        end["exitCode"] = exit_code
        end["error"] = f"exit status {exit_code}"
    return {"event": {"end": end}}


KEEPALIVE_EVENT: dict[str, Any] = {"event": {"keepalive": {}}}

# ------------------------------------------------------------------------------------------------ envd: filesystem


class PathRequest(_In):
    """Stat, MakeDir, Remove (``path``) and ListDir (``path``, ``depth``)."""

    path: str = ""
    depth: int = 0


class WatchRequest(_In):
    path: str = ""
    recursive: bool = False


class MoveRequest(_In):
    source: str = ""
    destination: str = ""


class EntryInfo(_Out):
    name: str
    type: str
    path: str
    size: str = "0"  # int64: a string in proto3 JSON
    mode: int = 0
    permissions: str = ""
    owner: str = ""
    group: str = ""
    modified_time: str | None = None
    symlink_target: str | None = None
    is_symlink: bool = False


# ------------------------------------------------------------------------------------------------ control plane


class NewSandbox(msgspec.Struct, rename="camel"):
    template_id: str = msgspec.field(name="templateID")
    timeout: int = 300  # the API's default (NewSandboxV2)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = None
    auto_pause: bool = False


class TimeoutRequest(msgspec.Struct):
    timeout: int


class ConnectSandbox(msgspec.Struct):
    timeout: int | None = None


class ForkRequest(msgspec.Struct):
    timeout: int | None = None
    count: int = 1


class SnapshotRequest(msgspec.Struct):
    name: str | None = None


class SandboxOut(msgspec.Struct, rename="camel", omit_defaults=True):
    """``Sandbox`` (create, connect, fork) and, with the detail fields, ``SandboxDetail``/``ListedSandbox``."""

    template_id: str = msgspec.field(name="templateID")
    sandbox_id: str = msgspec.field(name="sandboxID")
    client_id: str = msgspec.field(name="clientID")
    envd_version: str  # always sent (no default: omit_defaults would leave it out)
    envd_access_token: str | None = None
    started_at: str | None = None
    end_at: str | None = None
    cpu_count: int | None = None
    memory_mb: int | None = msgspec.field(default=None, name="memoryMB")
    disk_size_mb: int | None = msgspec.field(default=None, name="diskSizeMB")
    state: str | None = None
    metadata: dict[str, str] | None = None


class SnapshotOut(msgspec.Struct, rename="camel"):
    snapshot_id: str = msgspec.field(name="snapshotID")
    names: list[str] = []
