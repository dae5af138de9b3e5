"""The server's protocol logic without workspaces (no root): framing, request parsing, authentication, bounds."""

from __future__ import annotations

import base64
import os
import signal
import struct
import subprocess
import time
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest

from bunshin_async import InvalidArgument
from bunshin_async._e2b import _envd, _wire
from bunshin_async._e2b._app import MAX_BODY, E2BApp
from bunshin_async._e2b._sandboxes import Sandboxes
from bunshin_async._e2b._server import is_loopback
from bunshin_async.integrations.e2b import E2BServer

pytestmark = pytest.mark.unit


def test_envelopes_round_trip_and_reject_malformed_bodies() -> None:
    msg = b'{"process":{"cmd":"/bin/bash"}}'
    assert _wire.unenvelope(_wire.envelope(msg)) == msg
    for bad, code in [
        (b"\x00\x00", "invalid_argument"),  # shorter than the prefix
        (struct.pack(">BI", 0, 100) + msg, "invalid_argument"),  # the length lies
        (struct.pack(">BI", 1, len(msg)) + msg, "unimplemented"),  # compressed
    ]:
        with pytest.raises(_wire.RpcError) as info:
            _wire.unenvelope(bad)
        assert info.value.code == code
    end = _wire.end_stream(_wire.RpcError("gone", code="not_found"))
    assert end[0] == _wire.FLAG_END_STREAM
    assert msgspec.json.decode(end[5:]) == {"error": {"code": "not_found", "message": "gone"}}
    assert msgspec.json.decode(_wire.end_stream()[5:]) == {}


def test_process_events_are_proto3_json() -> None:
    encode = msgspec.json.encode
    assert msgspec.json.decode(encode(_wire.data_event("stdout", b"\xffhi"))) == {
        "event": {"data": {"stdout": base64.b64encode(b"\xffhi").decode()}}
    }
    assert msgspec.json.decode(encode(_wire.end_event(0))) == {
        "event": {"end": {"exited": True, "status": "exit status 0"}}
    }
    assert msgspec.json.decode(encode(_wire.end_event(3)))["event"]["end"]["exitCode"] == 3
    req = msgspec.json.decode(
        b'{"process":{"cmd":"/bin/bash","args":["-l","-c","ls"],"cwd":"/tmp","future":1},"stdin":true}',
        type=_wire.StartRequest,
    )
    assert (req.process.cmd, req.process.args, req.process.cwd, req.stdin) == (
        "/bin/bash",
        ["-l", "-c", "ls"],
        "/tmp",
        True,
    )


def test_users_and_paths_are_validated() -> None:
    basic = "Basic " + base64.b64encode(b"root:").decode()
    assert _envd.user_from(basic) == "root"
    assert _envd.user_from(None) is None
    for bad in ["Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"a b:").decode()]:
        with pytest.raises(_wire.RpcError):
            _envd.user_from(bad)
    assert _envd.absolute("notes.txt") == "/home/user/notes.txt"
    assert _envd.absolute("~/a/../b") == "/home/user/b"
    assert _envd.absolute("/tmp//x/") == "/tmp/x"
    for bad in ["", "a\0b", "x" * 5000]:
        with pytest.raises(_wire.RpcError):
            _envd.absolute(bad)


def test_commands_from_a_client_are_checked() -> None:
    _envd.check_config(_wire.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", "ls"], envs={"A_1": "x"}))
    for bad in [
        _wire.ProcessConfig(cmd=""),
        _wire.ProcessConfig(cmd="/bin/bash", args=["a\0b"]),
        _wire.ProcessConfig(cmd="/bin/bash", envs={"A=B": "x"}),
        _wire.ProcessConfig(cmd="/bin/bash", envs={"A": "x\0y"}),
    ]:
        with pytest.raises(_wire.RpcError) as info:
            _envd.check_config(bad)
        assert info.value.code == "invalid_argument"


def test_a_commands_stdin_holder_is_named_only_once_the_command_holds_its_end(tmp_path: Path) -> None:
    """The start wrapper (run here by the host's /bin/sh) writes ``hold`` after the command's end of the FIFO is
    open: ending the holder at once, as a ``close_stdin`` right after the start does, gives the command what was
    sent and an end of file. (The holder named before that open was ended, 1 time in 5, while the command's open
    still waited for a writer, which then never came: the command hung and the input was lost.)"""
    for i in range(20):
        d = tmp_path / "p" / str(i)
        argv = ["/bin/sh", "-c", _envd._WRAPPER, "sh", str(d), "1", "sh", "-c", "cat; echo done"]
        proc = subprocess.Popen(argv)
        try:
            deadline = time.monotonic() + 30  # a hang guard
            while not ((d / "hold").exists() and (d / "hold").read_text().strip()):
                assert time.monotonic() < deadline, "the wrapper named no holder"
            # the wrapper (which becomes the command) already reads the FIFO: the holder is not its only end
            fds = [os.path.realpath(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
            assert os.path.realpath(d / "in") in fds
            with open(d / "in", "wb") as fifo:  # send_stdin: a reader is there, the write does not wait
                fifo.write(b"sent\n")
            os.kill(int((d / "hold").read_text()), signal.SIGTERM)  # close_stdin
            assert proc.wait(timeout=30) == 0  # a hang guard: the command reads to its end of file
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert (d / "out").read_text() == "sent\ndone\n"


def test_find_output_parses_into_entries() -> None:
    rows = [
        ["f", "f", "5", "644", "-rw-r--r--", "root", "root", "1700000000.5", "", "/tmp/a.txt"],
        ["l", "d", "4", "777", "lrwxrwxrwx", "root", "root", "1700000000", "/etc", "/tmp/link"],
    ]
    out = "".join("\x00".join(r) + "\x00" for r in rows) + "garbage\n"
    a, link = _envd._entries(out)
    assert (a.name, a.type, a.size, a.mode, a.is_symlink) == ("a.txt", "FILE_TYPE_FILE", "5", 0o644, False)
    assert (link.type, link.symlink_target, link.is_symlink) == ("FILE_TYPE_DIRECTORY", "/etc", True)


def test_hostile_find_output_parses_into_bounded_entries() -> None:
    # A workspace's find (or /etc/passwd, or a link target) prints what it likes, but never a NUL inside a field.
    rows = [
        ["l", "N", "0", "777", "lrwxrwxrwx", "\nroot", "root", "1e400", "\n/fake\x00entry", "/tmp/l"],
        ["f", "f", "\u00b2", "99", "-rw", "root", "root", "nan", "", "/tmp/\nb"],
    ]
    out = "".join("\x00".join(r) + "\x00" for r in rows)
    entries = _envd._entries(out.replace("/fake\x00entry", "/fake entry"))
    assert [(e.path, e.size, e.mode) for e in entries] == [("/tmp/l", "0", 0o777), ("/tmp/\nb", "0", 0)]
    assert entries[0].symlink_target == "\n/fake entry" and entries[0].owner == "\nroot"
    assert {e.modified_time for e in entries} == {"1970-01-01T00:00:00Z"}


def test_a_public_address_needs_a_key() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    with pytest.raises(InvalidArgument):
        E2BServer(host="0.0.0.0")
    with pytest.raises(InvalidArgument):
        E2BServer(api_key="short")
    assert E2BServer(host="0.0.0.0", api_key="a-long-enough-key").api_key == "a-long-enough-key"
    assert len(E2BServer().api_key) >= 24  # a random key by default, never none


async def test_the_app_checks_keys_tokens_ids_and_bounds() -> None:
    async with anyio.create_task_group() as tg:
        app = E2BApp(Sandboxes(), "the-key-123", tg)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://e2b") as client:
            assert (await client.get("/v2/sandboxes")).status_code == 401
            assert (await client.get("/v2/sandboxes", headers={"X-API-KEY": "wrong"})).status_code == 401
            key = {"X-API-KEY": "the-key-123"}
            assert (await client.get("/v2/sandboxes", headers=key)).json() == []
            assert (await client.get("/sandboxes/..%2Fetc", headers=key)).status_code == 404
            assert (await client.get("/sandboxes/abc123", headers=key)).status_code == 404
            big = b"x" * (MAX_BODY + 1)
            assert (await client.post("/v2/sandboxes", headers=key, content=big)).status_code == 413
            bad = await client.post("/v2/sandboxes", headers=key, content=b'{"templateID": 5}')
            assert bad.status_code == 400
            legacy = await client.post("/v2/templates", headers=key, content=b"{}")  # the SDK's older build API
            assert legacy.status_code == 501 and "bunshin image import" in legacy.json()["message"]
            assert (await client.post("/v3/templates", headers=key, content=b"{}")).status_code == 400  # no name
            status = await client.get("/templates/tpl00/builds/bld00/status", headers=key)
            assert status.status_code == 404
            # envd: an unknown sandbox is what E2B's proxy says about a killed one
            gone = await client.post("/process.Process/List", headers={"E2b-Sandbox-Id": "abc123"}, content=b"{}")
            assert gone.status_code == 502 and "was not found" in gone.json()["message"]
        tg.cancel_scope.cancel()
