"""The gaps of stock CRIU 4.2.1 that a live fork must close (issue #3, item 7), each checked through the SDK:

- a loopback TCP connection with unsent data in its send queue restores, and the data arrives intact
  (criu/patches/0004-tcp-unsent-queue.patch);
- fanotify marks, filesystem marks included, still fire in the copy (0005-fanotify-sb-marks.patch);
- the copy's restore log has no "Address already assigned" noise for the loopback's own addresses
  (0006-quiet-ifaddr-restore.patch).

Against a CRIU without those patches the first fails the fork, the filesystem-mark case sees no event in the copy
and the last finds the noise."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from bunshin_async import Security, Workspace
from bunshin_async._fork._snapshot import record_of

HERE = Path(__file__).parent
TCP_TOTAL = 4 << 20  # gaps_guest.TCP_TOTAL


@pytest.fixture
async def ws() -> AsyncIterator[Workspace]:
    # fanotify mount and filesystem marks need CAP_SYS_ADMIN of the host's user namespace, a loopback address
    # CAP_NET_ADMIN: the CRIU patches under test serve workspaces that are given them, so these keep them, without
    # a user namespace (explicit relaxations).
    async with Workspace(security=Security(capabilities=("SYS_ADMIN", "NET_ADMIN"), userns=False)) as w:
        await w.write_file("/workspace/gaps_guest.py", (HERE / "gaps_guest.py").read_bytes())
        yield w


async def _wait_file(ws: Workspace, path: str, want: str | None = None, timeout: float = 30.0) -> str:
    with anyio.fail_after(timeout):
        while True:
            r = await ws.exec(f"cat {path} 2>/dev/null")
            if r.exit_code == 0 and r.stdout and (want is None or r.stdout.strip() == want):
                return r.stdout.strip()
            await anyio.sleep(0.05)


def _expected_digest() -> str:
    block = hashlib.sha256(b"bunshin").digest() * 2048
    return hashlib.sha256((block * (TCP_TOTAL // len(block) + 1))[:TCP_TOTAL]).hexdigest()


async def test_tcp_unsent_data_arrives_in_copy(ws: Workspace) -> None:
    await ws.spawn(["python3", "/workspace/gaps_guest.py", "tcpunsent"], log_path="/workspace/tcp.log")
    _sent, unsent = map(int, (await _wait_file(ws, "/workspace/tcp.ready")).split())
    assert unsent > 0, "the sender's queue must hold not-sent data at the fork"
    (copy,) = await ws.fork()
    try:
        want = f"{TCP_TOTAL} {_expected_digest()}"
        for w in (copy, ws):  # the copy first: the parent's socket must not matter to it
            await w.write_file("/workspace/go", "1")
            assert await _wait_file(w, "/workspace/tcp.result") == want
        assert (await copy.exec("cat /workspace/tcp.log")).stdout == ""
    finally:
        await copy.aclose()


@pytest.mark.parametrize(
    ("kind", "target"),
    [("inode", "/workspace/watched"), ("mount", "/workspace"), ("filesystem", "/workspace"), ("filesystem", "/")],
)
async def test_fanotify_marks_fire_in_copy(ws: Workspace, kind: str, target: str) -> None:
    await ws.spawn(["python3", "/workspace/gaps_guest.py", "fanotify", kind, target], log_path="/workspace/fan.log")
    await _wait_file(ws, "/workspace/fan.count", "0")
    await ws.exec("echo 1 >> /workspace/watched")
    await _wait_file(ws, "/workspace/fan.count", "1")
    (copy,) = await ws.fork()
    try:
        for w in (copy, ws):
            await w.exec("echo 2 >> /workspace/watched")
            assert await _wait_file(w, "/workspace/fan.count", "2", timeout=10) == "2"
        assert (await copy.exec("cat /workspace/fan.error /workspace/fan.log 2>/dev/null")).stdout == ""
    finally:
        await copy.aclose()


ADD_ADDR = """
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ifr = struct.pack("16sH2s4s8s", b"lo:1", socket.AF_INET, b"\\0\\0", socket.inet_aton("10.9.8.7"), b"\\0" * 8)
fcntl.ioctl(s, 0x8916, ifr)  # SIOCSIFADDR
"""
GET_ADDRS = """
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for name in (b"lo", b"lo:1"):
    try:
        r = fcntl.ioctl(s, 0x8915, struct.pack("16s16s", name, b"\\0" * 16))  # SIOCGIFADDR
        print(name.decode(), socket.inet_ntoa(r[20:24]))
    except OSError:
        pass
"""


@pytest.mark.parametrize("configured", [False, True], ids=["plain", "configured"])
async def test_restore_log_has_no_address_noise(ws: Workspace, configured: bool) -> None:
    """A workspace whose net namespace is as it started gets a fresh one per copy (``plain_netns``: CRIU leaves
    it out); one with an address of its own is dumped and restored by CRIU, without noise for loopback's own."""
    if configured:
        r = await ws.exec(["python3", "-c", ADD_ADDR])
        assert r.exit_code == 0, r.stderr
    async with await ws.snapshot() as snap:
        assert record_of(snap).fresh_net is not configured
        (copy,) = await Workspace.from_snapshot(snap)
    try:
        log = (copy.directory / "restore.log").read_text(errors="replace")
        assert "already assigned" not in log.lower()
        # The loopback's addresses are there all the same, and the workspace's own.
        r = await copy.exec(["python3", "-c", "import socket; socket.create_server(('127.0.0.1', 0)); print('ok')"])
        assert r.stdout == "ok\n", r.stderr
        assert "00000000000000000000000000000001" in (await copy.exec("cat /proc/net/if_inet6")).stdout
        addrs = (await copy.exec(["python3", "-c", GET_ADDRS])).stdout.split("\n")
        assert addrs[: 1 + configured] == ["lo 127.0.0.1", "lo:1 10.9.8.7"][: 1 + configured]
    finally:
        await copy.aclose()
