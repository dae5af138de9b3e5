"""A workspace's UTS and IPC namespaces are dumped by CRIU itself, entering each with ``setns()`` and returning,
instead of by a forked child each (criu/patches/0019, docs/concepts/fork-pause.md: the forks cost 1-4 ms with the
tree frozen). CRIU's log says how it dumped them; what it read must be the workspace's namespaces, not CRIU's own:
a copy has the workspace's host name and the SysV message queue (with its message) made inside it. Log lines and
answers, never timings."""

from __future__ import annotations

import re

import pytest

from bunshin_async import Snapshot, Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host._criu import criu_features

pytestmark = [pytest.mark.fork_modes("criu-cow"), pytest.mark.tracked]

IN_PLACE = "ns-in-place"  # the feature criu/patches/0019 adds to `criu --version`
HOSTNAME = "uts-in-place"
# msgget/msgsnd/msgrcv through libc: a queue keyed KEY holding one message; `get` prints it, left in the queue
IPC = (
    "import ctypes, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "class Msg(ctypes.Structure):\n"
    "    _fields_ = [('mtype', ctypes.c_long), ('mtext', ctypes.c_char * 64)]\n"
    "KEY, IPC_CREAT, IPC_NOWAIT, MSG_COPY = 0x39019, 0o1000, 0o4000, 0o40000\n"
    "q = libc.msgget(KEY, IPC_CREAT | 0o600 if sys.argv[1] == 'put' else 0)\n"
    "assert q >= 0, ctypes.get_errno()\n"
    "m = Msg(7, b'message in the workspace queue')\n"
    "if sys.argv[1] == 'put':\n"
    "    assert libc.msgsnd(q, ctypes.byref(m), 64, 0) == 0, ctypes.get_errno()\n"
    "else:\n"
    "    m = Msg()\n"
    "    n = libc.msgrcv(q, ctypes.byref(m), 64, 0, IPC_NOWAIT | MSG_COPY)\n"
    "    assert n == 64, ctypes.get_errno()\n"
    "    print(m.mtype, m.mtext.decode())\n"
)


def ns_dumps(snap: Snapshot) -> list[str]:
    """How the snapshot's dump wrote the UTS and IPC namespaces (CRIU's log)."""
    log = (record_of(snap).images / "dump.log").read_text(errors="replace")
    return re.findall(r"Dump (UTS|IPC) namespace \d+ via \d+(.*)", log)


async def test_uts_and_ipc_namespaces_are_dumped_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_CRIU_LOG_LEVEL", "3")  # CRIU logs how it dumped each namespace
    assert IN_PLACE in criu_features(), "CRIU lacks criu/patches/0019: run criu/build.sh"
    async with Workspace(hostname=HOSTNAME) as ws:
        await ws.write_file("/workspace/ipc.py", IPC)
        r = await ws.exec(["python3", "/workspace/ipc.py", "put"])
        assert r.exit_code == 0, r.stderr
        await ws.spawn(["sleep", "1000"])  # a process besides init and the agent
        async with await ws.snapshot() as snap:
            assert sorted(ns_dumps(snap)) == [("IPC", ", in place"), ("UTS", ", in place")]
            [copy] = await Workspace.from_snapshot(snap)
            try:
                assert (await copy.exec("hostname")).stdout == f"{HOSTNAME}\n"
                r = await copy.exec(["python3", "/workspace/ipc.py", "get"])
                assert (r.exit_code, r.stdout) == (0, "7 message in the workspace queue\n"), r.stderr
            finally:
                await copy.aclose()
