"""The unmodified ``e2b`` SDK, synchronous and asynchronous, against ``E2BServer`` on Bunshin workspaces."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time

import anyio
import e2b
import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    NotFoundException,
    Sandbox,
    SandboxQuery,
)

from bunshin_async._e2b._backends import LocalHandle
from bunshin_async._workspace._accounting import pss_bytes

from .conftest import Served

pytestmark = pytest.mark.root

HEAP_MIB = 48
# A process whose memory is the evidence: a random token and a heap, both only in memory; a stdin line asks for the
# token and a digest of the heap (reading every page of it).
MEMORY_HOLDER = (
    "import hashlib, os, sys\n"
    f"heap = bytearray(os.urandom(1 << 20)) * {HEAP_MIB}\n"
    "token = os.urandom(8).hex()\n"
    "print('ready', flush=True)\n"
    "for line in sys.stdin:\n"
    "    print(token, hashlib.sha256(heap).hexdigest()[:16], flush=True)\n"
)


async def _ask(sbx: AsyncSandbox, pid: int) -> str:
    """The memory holder's answer: send a line, read the next line of its output through a Connect stream."""
    lines: list[str] = []
    got = anyio.Event()

    def on_stdout(chunk: str) -> None:
        lines.append(chunk)
        if "\n" in "".join(lines):
            got.set()

    handle = await sbx.commands.connect(pid, on_stdout=on_stdout, timeout=0)
    try:
        await sbx.commands.send_stdin(pid, "?\n")
        with anyio.fail_after(30):
            await got.wait()
    finally:
        await handle.disconnect()
    return "".join(lines).splitlines()[0]


async def _start_holder(sbx: AsyncSandbox) -> int:
    await sbx.files.write("/home/user/holder.py", MEMORY_HOLDER)
    ready = anyio.Event()
    handle = await sbx.commands.run(
        "exec python3 /home/user/holder.py",
        background=True,
        stdin=True,
        timeout=0,
        on_stdout=lambda chunk: ready.set() if "ready" in chunk else None,
    )
    with anyio.fail_after(30):
        await ready.wait()
    await handle.disconnect()
    return handle.pid


def test_sync_lifecycle_commands_and_exit_code(e2b_server: Served) -> None:
    sbx = Sandbox.create(metadata={"suite": "sync"}, envs={"FROM_CREATE": "yes"})
    try:
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        with pytest.raises(CommandExitException) as info:
            sbx.commands.run("echo hi; echo err >&2; exit 3")
        assert (info.value.exit_code, info.value.stdout, info.value.stderr) == (3, "hi\n", "err\n")
        # cwd, env and the default working directory (E2B's home)
        assert sbx.commands.run("pwd").stdout == "/home/user\n"
        assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        assert sbx.commands.run("echo $GREETING", envs={"GREETING": "hello"}).stdout == "hello\n"
        assert sbx.commands.run("id -un", user="nobody").stdout == "nobody\n"
        assert sbx.commands.run("id -un", user="root").stdout == "root\n"
        assert sbx.commands.run("echo $FROM_CREATE").stdout == "yes\n"
        # output larger than what a pump reads at once, past the offset where it reads with tail, on both streams
        big = sbx.commands.run("head -c 5000000 /dev/zero | tr '\\0' a; head -c 300000 /dev/zero | tr '\\0' b >&2")
        assert (big.stdout, big.stderr) == ("a" * 5_000_000, "b" * 300_000)
        # a finished command leaves no control directory behind (it goes just after the command's end is sent: only
        # the one of the command asking is left once the one before has gone)
        for _ in range(50):
            if sbx.commands.run("ls /run/e2b/p | wc -l").stdout == "1\n":
                break
            time.sleep(0.2)
        else:
            raise AssertionError(sbx.commands.run("ls /run/e2b/p").stdout)
        info_ = sbx.get_info()
        assert (info_.sandbox_id, info_.metadata, info_.state.value) == (sbx.sandbox_id, {"suite": "sync"}, "running")
        assert sbx.is_running()
    finally:
        sbx.kill()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    assert not sbx.is_running()


def test_sync_files_round_trip(e2b_server: Served) -> None:
    with Sandbox.create() as sbx:
        blob = bytes(range(256)) * 1000
        sbx.files.write("/tmp/t/a.txt", "hello\n")
        sbx.files.write("rel.bin", blob)  # relative: the home directory
        sbx.files.write("/tmp/t/stream.bin", io.BytesIO(blob))
        sbx.files.write_files([{"path": "/tmp/t/b.txt", "data": "b"}, {"path": "/tmp/t/c.txt", "data": b"c"}])
        assert sbx.files.read("/tmp/t/a.txt") == "hello\n"
        assert bytes(sbx.files.read("/home/user/rel.bin", format="bytes")) == blob
        assert b"".join(sbx.files.read("/tmp/t/stream.bin", format="stream")) == blob
        names = sorted(e.name for e in sbx.files.list("/tmp/t"))
        assert names == ["a.txt", "b.txt", "c.txt", "stream.bin"]
        info = sbx.files.get_info("/tmp/t/a.txt")
        assert (info.type.value, info.size, info.path) == ("file", 6, "/tmp/t/a.txt")
        assert sbx.files.make_dir("/tmp/t/sub") is True
        assert sbx.files.make_dir("/tmp/t/sub") is False
        sbx.files.rename("/tmp/t/a.txt", "/tmp/t/sub/a2.txt")
        assert not sbx.files.exists("/tmp/t/a.txt")
        assert sbx.files.read("/tmp/t/sub/a2.txt") == "hello\n"
        sbx.files.remove("/tmp/t/sub")
        assert not sbx.files.exists("/tmp/t/sub")
        with pytest.raises(FileNotFoundException):
            sbx.files.read("/tmp/t/missing")


async def test_async_background_stream_stdin_kill(e2b_server: Served) -> None:
    sbx = await AsyncSandbox.create()
    try:
        out: list[str] = []
        echoed = anyio.Event()

        def on_stdout(chunk: str) -> None:
            out.append(chunk)
            if "ping" in "".join(out):
                echoed.set()

        handle = await sbx.commands.run("cat", background=True, stdin=True, on_stdout=on_stdout, timeout=0)
        await sbx.commands.send_stdin(handle.pid, "ping\n")
        with anyio.fail_after(30):
            await echoed.wait()
        assert handle.pid in [p.pid for p in await sbx.commands.list()]
        assert await handle.kill()
        with pytest.raises(CommandExitException) as info:
            await handle.wait()
        assert info.value.exit_code == 128 + signal.SIGKILL
        assert handle.pid not in [p.pid for p in await sbx.commands.list()]
        # streamed as produced: the first line arrives while the command still runs
        seen = anyio.Event()
        slow = await sbx.commands.run(
            "echo first; sleep 30", background=True, on_stdout=lambda c: seen.set(), timeout=0
        )
        with anyio.fail_after(20):
            await seen.wait()
        assert slow.exit_code is None
        await slow.kill()
        # a sandbox killed under a running command: the SDK reports it gone
        other = await AsyncSandbox.create()
        waiting = await other.commands.run("sleep 60", background=True, timeout=0)
        await AsyncSandbox.kill(other.sandbox_id)
        with pytest.raises(e2b.SandboxNotRunningException):
            await waiting.wait()
        with pytest.raises(e2b.SandboxNotRunningException):
            await other.files.read("/etc/hostname")
        # the command's timeout kills it, as envd does
        with pytest.raises(e2b.TimeoutException):
            await sbx.commands.run("sleep 30", timeout=1)
    finally:
        await sbx.kill()


async def test_async_fork_inherits_files_and_processes_and_shares_memory(e2b_server: Served) -> None:
    sbx = await AsyncSandbox.create()
    copies: list[AsyncSandbox] = []
    try:
        await sbx.files.write("/home/user/state.txt", "parent")
        pid = await _start_holder(sbx)
        before = await _ask(sbx, pid)
        copies = [c for c in await sbx.fork(count=4) if isinstance(c, AsyncSandbox)]
        assert len(copies) == 4
        for i, copy in enumerate(copies):
            assert await copy.files.read("/home/user/state.txt") == "parent"
            assert pid in [p.pid for p in await copy.commands.list()]
            assert await _ask(copy, pid) == before  # the same token and heap: the process with its memory
            await copy.files.write("/home/user/state.txt", f"copy {i}")
        for i, copy in enumerate(copies):
            assert await copy.files.read("/home/user/state.txt") == f"copy {i}"
        assert await sbx.files.read("/home/user/state.txt") == "parent"
        # the copies' heaps are one set of pages: their proportional share is far below four private heaps
        pss = sum(_pss_kib(e2b_server, c.sandbox_id) for c in copies)
        assert pss < 2 * HEAP_MIB * 1024, pss
    finally:
        for copy in copies:
            await copy.kill()
        await sbx.kill()


def _pss_kib(served: Served, sandbox_id: str) -> int:
    handle = served.server.sandboxes.get(sandbox_id).ws
    assert isinstance(handle, LocalHandle)
    ws = handle.workspace
    assert ws.cgroup is not None
    return pss_bytes(ws.cgroup.pids()) // 1024


async def test_async_snapshot_and_pause_resume(e2b_server: Served) -> None:
    sbx = await AsyncSandbox.create()
    made: list[AsyncSandbox] = []
    try:
        await sbx.files.write("/home/user/state.txt", "snapped")
        pid = await _start_holder(sbx)
        answer = await _ask(sbx, pid)
        snap = await sbx.create_snapshot()
        assert snap.snapshot_id in [s.snapshot_id for s in await AsyncSandbox.list_snapshots().next_items()]
        made.append(await AsyncSandbox.create(snap.snapshot_id))
        assert await made[0].files.read("/home/user/state.txt") == "snapped"
        assert await _ask(made[0], pid) == answer
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id)
        # pause keeps processes, memory and files; connect resumes
        await sbx.pause()
        paused = await AsyncSandbox.get_info(sbx.sandbox_id)
        assert paused.state.value == "paused"
        assert (paused.end_at - paused.started_at).total_seconds() > 3600  # kept, not reaped with its timeout
        with pytest.raises(e2b.SandboxException, match="not running"):
            await sbx.fork(count=1)
        resumed = await AsyncSandbox.connect(sbx.sandbox_id)
        assert (await resumed.get_info()).state.value == "running"
        assert await resumed.files.read("/home/user/state.txt") == "snapped"
        assert await _ask(resumed, pid) == answer
    finally:
        for other in made:
            await other.kill()
        await sbx.kill()


async def test_async_concurrent_creates_and_metadata_filter(e2b_server: Served) -> None:
    async def create(i: int) -> None:
        sandboxes.append(await AsyncSandbox.create(metadata={"batch": "b32", "i": str(i)}))

    sandboxes: list[AsyncSandbox] = []
    try:
        async with anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(create, i)
        listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"batch": "b32"})).next_items()
        assert len(listed) == 32
        assert [s.sandbox_id for s in await AsyncSandbox.list(query=SandboxQuery(metadata={"i": "7"})).next_items()]
        assert len({s.sandbox_id for s in sandboxes}) == 32
    finally:
        async with anyio.create_task_group() as tg:
            for s in sandboxes:
                tg.start_soon(s.kill)
    assert await AsyncSandbox.list(query=SandboxQuery(metadata={"batch": "b32"})).next_items() == []


async def test_a_dead_client_leaves_nothing_after_its_timeout(e2b_server: Served) -> None:
    script = "import e2b, sys, time; s = e2b.Sandbox.create(timeout=99); print(s.sandbox_id, flush=True); time.sleep(9)"
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            sandbox_id = (await anyio.to_thread.run_sync(proc.stdout.readline)).strip()
        finally:
            proc.send_signal(signal.SIGKILL)
    # Outlives its client (a short create timeout raced this check on a loaded machine); then its timeout ends it.
    assert (await AsyncSandbox.get_info(sandbox_id)).state.value == "running"
    await AsyncSandbox.set_timeout(sandbox_id, 1)
    with anyio.fail_after(30):
        while e2b_server.server.sandboxes.reaped == 0:
            await anyio.sleep(0.2)
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(sandbox_id)


async def test_auth_and_errors(e2b_server: Served) -> None:
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(api_key="not-the-key")
    with pytest.raises(e2b.SandboxException, match="bunshin image import"):
        await AsyncSandbox.create("no-such-template")
    async with await AsyncSandbox.create() as sbx:
        # envd refuses a client without the sandbox's access token
        stranger = AsyncSandbox(
            sandbox_id=sbx.sandbox_id,
            sandbox_domain=None,
            envd_version=sbx._envd_version,
            envd_access_token="wrong",
            connection_config=e2b.ConnectionConfig(
                **e2b_server.opts, extra_sandbox_headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "x"}
            ),
        )
        with pytest.raises(AuthenticationException):
            await stranger.commands.run("true")


async def test_async_watch_dir_sees_create_write_remove(e2b_server: Served) -> None:
    async with await AsyncSandbox.create() as sbx:
        await sbx.files.make_dir("/tmp/w")
        seen: list[tuple[str, str]] = []

        def on_event(event: e2b.FilesystemEvent) -> None:
            seen.append((event.name, event.type.value))

        async def expect(name: str, kind: str) -> None:
            with anyio.fail_after(20):
                while (name, kind) not in seen:
                    await anyio.sleep(0.05)

        handle = await sbx.files.watch_dir("/tmp/w", on_event=on_event, timeout=0)
        try:
            await sbx.files.write("/tmp/w/a.txt", "x")
            await expect("a.txt", "create")
            await sbx.files.write("/tmp/w/a.txt", "xyz")
            await expect("a.txt", "write")
            await sbx.files.remove("/tmp/w/a.txt")
            await expect("a.txt", "remove")
        finally:
            await handle.stop()
        with pytest.raises(e2b.SandboxException):
            await sbx.files.watch_dir("/tmp/missing", on_event=on_event)


@pytest.mark.slow
async def test_a_docker_reference_is_a_template(e2b_server: Served) -> None:
    from tests.images._build import bookworm

    tag = await anyio.to_thread.run_sync(bookworm)  # an image of the local Docker engine, not imported yet
    sandboxes = []
    try:
        async with anyio.create_task_group() as tg:  # two creates of one reference share one import

            async def create() -> None:
                sandboxes.append(await AsyncSandbox.create(tag))

            tg.start_soon(create)
            tg.start_soon(create)
        for sbx in sandboxes:
            assert (await sbx.commands.run("cat /etc/debian_version")).stdout.startswith("12")
            assert (await sbx.get_info()).template_id == tag
    finally:
        for sbx in sandboxes:
            await sbx.kill()


async def test_async_template_build_is_a_snapshot_of_the_built_workspace(e2b_server: Served) -> None:
    template = (
        e2b.Template()
        .from_template("base")
        .set_envs({"GREETING": "built"})
        .run_cmd("mkdir -p /srv/app && echo marker > /srv/app/marker")
        .set_workdir("/srv/app")
        .set_start_cmd(
            'python3 -c \'import time; open("/tmp/ready", "w").close(); time.sleep(3600)\'', "test -e /tmp/ready"
        )
    )
    logs: list[str] = []
    await e2b.AsyncTemplate.build(template, "bunshin-tpl", on_build_logs=lambda e: logs.append(e.message))
    assert any("build ready" in line for line in logs)
    assert await e2b.AsyncTemplate.exists("bunshin-tpl")
    assert not await e2b.AsyncTemplate.exists("no-such-tpl")
    async with await AsyncSandbox.create("bunshin-tpl") as sbx:
        assert (await sbx.commands.run("cat marker; pwd; echo $GREETING")).stdout == "marker\n/srv/app\nbuilt\n"
        assert (await sbx.commands.run("pgrep -f time.sleep")).exit_code == 0  # the start command still runs
    failing = e2b.Template().from_template("base").run_cmd("exit 7")
    with pytest.raises(e2b.BuildException, match="exited with 7"):
        await e2b.AsyncTemplate.build(failing, "bunshin-bad")
    copying = e2b.Template().from_template("base").copy("conftest.py", "/tmp/x.py")
    with pytest.raises(e2b.exceptions.FileUploadException, match="COPY"):
        await e2b.AsyncTemplate.build(copying, "bunshin-copy")


async def test_close_stdin_ends_a_commands_input_and_pty_is_refused(e2b_server: Served) -> None:
    sbx = await AsyncSandbox.create()
    try:
        wc = await sbx.commands.run("wc -c", background=True, stdin=True)
        await sbx.commands.send_stdin(wc.pid, "hello\n")
        await sbx.commands.send_stdin(wc.pid, "world\n")
        await sbx.commands.close_stdin(wc.pid)  # wc reads to its end of file and prints the count
        assert (await wc.wait()).stdout == "12\n"
        with pytest.raises(e2b.SandboxException):
            await sbx.commands.send_stdin(wc.pid, "late\n")
        cat = await sbx.commands.run("cat; echo done", background=True, stdin=True)
        await cat.close_stdin()  # the handle's own, with nothing sent
        assert (await cat.wait()).stdout == "done\n"
        # the stdin holders leave with their commands (within a second: they look every second; 30 s is a hang guard)
        left = "grep -h -x -e wc -e cat -e sleep /proc/[0-9]*/comm 2>/dev/null"
        wait = f'for i in $(seq 300); do n=$({left}); [ -z "$n" ] && break; sleep 0.1; done; echo "[$n]"'
        assert (await sbx.commands.run(wait)).stdout == "[]\n"
        with pytest.raises(e2b.SandboxException, match="PTY sessions are not served"):
            await sbx.pty.create(e2b.PtySize(rows=24, cols=80), on_data=lambda data: None)
    finally:
        await sbx.kill()
