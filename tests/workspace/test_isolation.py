"""A workspace cannot touch the host: filesystem, network, processes, memory."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import anyio

from bunshin_async import Limits, Workspace


async def test_cannot_write_or_read_the_host_filesystem() -> None:
    marker = Path(tempfile.mkdtemp(prefix="bunshin-host-")) / "secret.txt"
    marker.write_text("host secret")
    try:
        async with Workspace() as ws:
            r = await ws.exec(f"cat {marker}; ls /root; echo pwned > {marker}; echo x > /host-file; ls /")
            assert "host secret" not in r.stdout
            assert marker.read_text() == "host secret"
            assert not Path("/host-file").exists()
            # The workspace's /etc is the image's, not the host's.
            shadow = await ws.exec("cat /etc/shadow")
            assert shadow.stdout != Path("/etc/shadow").read_text()
            assert (await ws.exec("hostname")).stdout == "bunshin\n"
            # Its changes land in its own upper layer only.
            await ws.exec("echo mine > /etc/motd-bunshin")
            assert (ws.directory / "upper/etc/motd-bunshin").read_text() == "mine\n"
    finally:
        marker.unlink()
        marker.parent.rmdir()


async def test_cannot_reach_a_host_loopback_server() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        async with Workspace() as ws:
            code = (
                "import socket\ns=socket.socket()\ns.settimeout(2)\n"
                f"try:\n s.connect(('127.0.0.1',{port})); print('connected')\n"
                "except OSError as e:\n print(type(e).__name__)\n"
            )
            r = await ws.exec(["python3", "-c", code])
            assert r.stdout.strip() == "ConnectionRefusedError"
            links = await ws.exec("ls /sys/class/net")
            assert links.stdout.split() == ["lo"]
            # Its own loopback works.
            r = await ws.exec(
                [
                    "python3",
                    "-c",
                    "import socket;s=socket.create_server(('127.0.0.1',8080));"
                    "c=socket.create_connection(('127.0.0.1',8080));print('ok')",
                ]
            )
            assert r.stdout == "ok\n"
    finally:
        listener.close()


async def test_cannot_see_host_processes() -> None:
    async with Workspace() as ws:
        r = await ws.exec("ps -eo pid,comm --no-headers")
        pids = {int(line.split()[0]) for line in r.stdout.splitlines()}
        assert max(pids) < 100 and 1 in pids
        assert (await ws.exec(f"kill -0 {os.getpid()}")).exit_code != 0 or os.getpid() in pids
        assert (await ws.exec(f"test -e /proc/{os.getpid()}/environ")).exit_code != 0 or os.getpid() < 100


async def test_memory_limit_kills_only_the_offender() -> None:
    async with Workspace(limits=Limits(memory=128 << 20)) as ws, Workspace() as sibling:
        hog = "x = bytearray(512 << 20); x[::4096] = b'a' * len(x[::4096]); print('survived')"
        r = await ws.exec(["python3", "-c", hog], timeout=60)
        assert r.exit_code == 137 and "survived" not in r.stdout
        assert (await ws.exec("echo alive")).stdout == "alive\n"
        assert ws.cgroup is not None
        peak = ws.cgroup.memory_peak()
        assert peak is not None and peak <= 128 << 20
        assert (await sibling.exec(["python3", "-c", hog.replace("512", "200")], timeout=60)).stdout == "survived\n"


async def test_pids_limit() -> None:
    async with Workspace(limits=Limits(pids=32)) as ws:
        r = await ws.exec("for i in $(seq 100); do sleep 5 & done 2>&1; wait", timeout=30)
        assert "fork" in r.stdout + r.stderr or "Resource temporarily unavailable" in r.stdout + r.stderr
        await ws.exec("pkill sleep || true")
        assert (await ws.exec("echo ok")).stdout == "ok\n"


async def test_own_devpts_lets_terminal_programs_run() -> None:
    async with Workspace() as ws:
        r = await ws.exec(
            "tmux new-session -d -s t 'bash --norc' && tmux send-keys -t t 'echo from-tmux-$((6*7))' Enter "
            "&& sleep 0.5 && tmux capture-pane -p -t t && tmux kill-server",
            timeout=30,
        )
        assert "from-tmux-42" in r.stdout, r
        with anyio.fail_after(5):
            assert (await ws.exec("ls /dev/pts")).stdout.split()[0] in ("0", "ptmx")


async def test_dev_is_a_private_minimal_tree() -> None:
    """/dev is the agent layer's curated directory (no host node such as the image's console shows through) and
    what a workspace writes under it, /dev/shm included, stays in that workspace."""
    async with Workspace() as a, Workspace() as b:
        names = set((await a.exec("ls -A /dev")).stdout.split())
        assert names == {"fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty",
                         "urandom", "zero"}  # fmt: skip
        assert (await a.exec("stat -c %a /dev/shm")).stdout == "1777\n"
        assert (await a.exec("echo x > /dev/shm/seg && echo y > /dev/extra")).exit_code == 0
        assert (await b.exec("ls /dev/shm/seg /dev/extra")).exit_code != 0
        r = await a.exec("head -c 4 /dev/zero | od -An -tx1; echo hi > /dev/null; readlink /dev/ptmx")
        assert r.stdout.split() == ["00", "00", "00", "00", "pts/ptmx"]
