"""The host-agent protocol (``bunshin_async._host._protocol``) as pure data, without a workspace: every message
round-trips through the one encoder and decoders in the shape the agent reads (a msgpack map tagged by ``op`` or
``kind``), unknown shapes are refused, and the C agent's tables (native/agent.c: op names, each op's fields with
their types and nullability, the version, the largest request) agree with ``_protocol.py``, the one definition."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bunshin_async._host import _protocol as P

pytestmark = pytest.mark.unit

AGENT_C = Path(__file__).resolve().parents[3] / "native" / "agent.c"

REQUESTS: list[P.Request] = [
    P.Ping(),
    P.Exec(argv=["ls", "-la"], cwd="/workspace", env={"A": "1"}, stdin=b"\x00\xff", timeout=1.5, user="1000:1000"),
    P.Exec(command="echo hi", max_output=10),
    P.ShellOpen(cwd="/", env={"X": "y"}, user="root"),
    P.ShellRun(shell_id=3, command="cd /tmp", timeout=None),
    P.ShellClose(shell_id=3),
    P.ReadFile(path="/workspace/a", max_bytes=4),
    P.WriteFile(path="a/b", data=b"\x00" * 3, append=True, mode=0o600, make_parents=False),
    P.ListDir(path="."),
    P.Remove(path="d", recursive=True),
    P.Spawn(argv=["sleep", "9"], log_path="/tmp/log"),
    P.Signal(pid=7, signal=15),
    P.Poll(pid=7),
]
RESPONSES: list[P.Response] = [
    P.Pong(version=P.PROTOCOL_VERSION, pid=1, shell="/bin/bash"),
    P.Ok(),
    P.ExecResult(exit_code=3, stdout="out\ufffd", stderr="", duration=0.25, truncated=True, shell="/bin/sh"),
    P.FileData(data=b"\x01\x02", truncated=False),
    P.DirListing(entries=[P.DirEntry("a", "file", 3), P.DirEntry("b", "symlink", 0)]),
    P.ShellOpened(shell_id=1),
    P.Spawned(pid=42),
    P.PollResult(returncode=None),
    P.Failure(error="not_found", message="no such file", path="/x"),
]


def test_every_request_and_response_round_trips_tagged() -> None:
    assert {type(r) for r in REQUESTS} == set(P.AnyRequest.__args__)  # type: ignore[attr-defined]
    assert {type(r) for r in RESPONSES} == set(P.AnyResponse.__args__)  # type: ignore[attr-defined]
    for req in REQUESTS:
        wire = P.request_encoder.encode(req)
        assert P.request_decoder.decode(wire) == req
        assert msgspec.msgpack.decode(wire)["op"] == type(req).__struct_config__.tag
    for resp in RESPONSES:
        wire = P.response_encoder.encode(resp)
        assert P.response_decoder.decode(wire) == resp
        assert msgspec.msgpack.decode(wire)["kind"] == type(resp).__struct_config__.tag


def test_optional_fields_may_be_absent_or_nil() -> None:
    absent = msgspec.msgpack.encode({"op": "exec", "command": "true"})
    nil = msgspec.msgpack.encode({"op": "exec", "command": "true", "cwd": None, "user": None})
    assert P.request_decoder.decode(absent) == P.request_decoder.decode(nil) == P.Exec(command="true")
    assert P.response_decoder.decode(msgspec.msgpack.encode({"kind": "pong", "version": 2, "pid": 1})).shell is None


@pytest.mark.parametrize(
    "message",
    [
        {"op": "exec", "command": "true", "sudo": True},  # an unknown field: requests forbid them
        {"op": "format_disk"},  # an unknown op
        {"op": "read_file"},  # a required field missing
        {"op": "signal", "pid": "1", "signal": 9},  # a wrong type
        {"command": "true"},  # no tag
    ],
)
def test_requests_of_unknown_shape_are_refused(message: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        P.request_decoder.decode(msgspec.msgpack.encode(message))


def test_responses_of_unknown_kind_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        P.response_decoder.decode(msgspec.msgpack.encode({"kind": "root_shell", "pid": 1}))
    with pytest.raises(msgspec.DecodeError):
        P.response_decoder.decode(b"\xc1")  # not msgpack at all


def _c_tables() -> tuple[dict[str, list[str]], dict[str, tuple[str, bool]], dict[str, int]]:
    """From agent.c: op name -> its field names, field name -> (type, nullable), and its #defines of interest."""
    src = AGENT_C.read_text()
    enum = re.search(r"enum op \{([^}]*)\}", src)
    names = re.search(r"op_names\[\] = \{([^}]*)\}", src)
    assert enum and names
    ops = dict(zip([e.strip() for e in enum.group(1).split(",")], re.findall(r'"(\w+)"', names.group(1)), strict=False))
    fields = {fid: (name, typ, nullable == "1") for fid, name, typ, nullable, _req in
              re.findall(r'\[(F_\w+)\] = \{"(\w+)", T_(\w+), (\d), (\d)\}', src)}  # fmt: skip
    macros = dict(re.findall(r"#define (\w+_FIELDS) (.*)", src))
    table = re.search(r"op_fields\[OP_COUNT\]\[\d+\] = \{(.*?)\n\};", src, re.S)
    assert table
    per_op: dict[str, list[str]] = {}
    for op, body in re.findall(r"\[(OP_\w+)\] = \{([^}]*)\}", table.group(1)):
        ids = [i.strip() for i in body.split(",") if i.strip() not in ("", "-1")]
        ids = [x.strip() for i in ids for x in (macros[i].split(",") if i in macros else [i])]
        per_op[ops[op]] = [fields[i][0] for i in ids]
    defines = {}
    for name, value in re.findall(r"#define (PROTOCOL_VERSION|MAX_REQUEST) ([^/\n]*)", src):
        shift = re.fullmatch(r"\(?(\d+)u? << (\d+)\)?", value.strip())
        defines[name] = int(shift.group(1)) << int(shift.group(2)) if shift else int(value)
    return per_op, {n: (t, nl) for n, t, nl in fields.values()}, defines


_C_TYPE = {
    msgspec.inspect.IntType: "INT",
    msgspec.inspect.FloatType: "FLOAT",
    msgspec.inspect.BoolType: "BOOL",
    msgspec.inspect.StrType: "STR",
    msgspec.inspect.BytesType: "BYTES",
    msgspec.inspect.ListType: "STRLIST",
    msgspec.inspect.DictType: "STRMAP",
}


def test_the_c_agent_reads_what_the_host_sends() -> None:
    per_op, fields, defines = _c_tables()
    assert defines == {"PROTOCOL_VERSION": P.PROTOCOL_VERSION, "MAX_REQUEST": P.MAX_REQUEST}
    requests = {cls.__struct_config__.tag: cls for cls in P.AnyRequest.__args__}  # type: ignore[attr-defined]
    assert set(per_op) == set(requests)
    for tag, cls in requests.items():
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        assert sorted(per_op[tag]) == sorted(f.name for f in info.fields), tag
        for f in info.fields:
            t = f.type
            nullable = isinstance(t, msgspec.inspect.UnionType)
            if nullable:
                (t,) = [x for x in t.types if not isinstance(x, msgspec.inspect.NoneType)]
            c_type, c_nullable = fields[f.name]
            assert _C_TYPE[type(t)] == c_type, (tag, f.name)
            assert c_nullable or not nullable, f"{tag}.{f.name}: the host may send nil, the agent refuses it"
