"""Filesystem-only forks (``fork_mode == "fs"``), the fallback when CRIU is unusable: files are carried, the
processes started with ``spawn`` are started again from the recorded setup, nothing in memory is carried."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from bunshin_async import BunshinError, CapabilityMissing, ForkError, SetupStep, Shell, Workspace
from bunshin_async._cli._doctor import report
from bunshin_async._fallback import reset_warnings
from bunshin_async._fork import _modes
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host import _criu, _paths

pytestmark = pytest.mark.fork_modes("fs")

PORT = 8765
COUNTER = """\
import http.server, os
hits = 0  # in memory only: a restarted server starts again from 0
with open("/workspace/boots", "a") as f:
    f.write(f"{os.getcwd()}\\n")

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global hits
        hits += 1
        body = f"{hits} {os.environ.get('GREETING')}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", PORT), H).serve_forever()
""".replace("PORT", str(PORT))


async def _get(ws: Workspace, timeout: float = 30.0) -> str:
    """One GET to the counter server, waiting for it to listen (a restarted one may still be starting)."""
    code = f"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{PORT}/').read().decode())"
    with anyio.fail_after(timeout):
        while True:
            r = await ws.exec(["python3", "-c", code], timeout=10)
            if r.exit_code == 0:
                return r.stdout.strip()
            await anyio.sleep(0.05)


async def _start_counter(ws: Workspace) -> SetupStep:
    await ws.exec("mkdir -p /workspace/srv")
    await ws.write_file("/workspace/srv/counter.py", COUNTER)
    proc = await ws.spawn(
        ["python3", "counter.py"], cwd="/workspace/srv", env={"GREETING": "hi"}, log_path="/workspace/srv/log"
    )
    assert proc.step is not None
    assert await _get(ws) == "1 hi"
    assert await _get(ws) == "2 hi"
    return proc.step


async def test_fs_fork_carries_files_and_restarts_processes(ws: Workspace) -> None:
    await ws.write_file("/workspace/shared", "before")
    counter = await _start_counter(ws)
    done = await ws.spawn("echo once >> /workspace/ran")  # exits: its effect is in the files, it is not re-run
    killed = await ws.spawn(["sleep", "1000"])
    await killed.kill()
    with anyio.fail_after(10):
        while await done.poll() is None or await killed.poll() is None:
            await anyio.sleep(0.02)
    sh = ws.shell()
    await sh.open()
    await sh.run("X=parent")
    assert len(ws.setup) == 3

    a, b = await ws.fork(2)
    try:
        assert [a.fork_mode, b.fork_mode, ws.fork_mode] == ["fs", "fs", "fresh"]
        for c in (a, b):
            assert [p.step for p in c.restarted_processes] == [counter]
            assert c.setup == [counter]
            for p in c.restarted_processes:
                assert p.workspace is c and await p.poll() is None
            assert c.restore_ms is not None
            # Memory is fresh (the counter starts again), env and cwd are as recorded, files are carried.
            assert await _get(c) == "1 hi"
            assert await c.read_text("/workspace/boots") == "/workspace/srv\n" * 2
            assert await c.read_text("/workspace/ran") == "once\n"
            assert await c.read_text("/workspace/shared") == "before"
            # Shell sessions are not carried.
            twin = Shell(c, cwd=None, env={})
            twin._id = sh._id
            with pytest.raises(BunshinError):
                await twin.run("echo $X")
        assert await _get(ws) == "3 hi"  # the parent's server kept its memory
        assert (await sh.run("echo $X")).stdout == "parent\n"
        assert await ws.read_text("/workspace/boots") == "/workspace/srv\n"

        await a.write_file("/workspace/shared", "a")
        await a.write_file("/workspace/only-a", "a")
        await ws.write_file("/workspace/only-parent", "p")
        assert await b.read_text("/workspace/shared") == "before"
        assert await ws.read_text("/workspace/shared") == "before"
        for other in (b, ws):
            assert (await other.exec("ls /workspace/only-a")).exit_code != 0
        assert (await a.exec("ls /workspace/only-parent")).exit_code != 0
        assert a.pid != b.pid != ws.pid
        assert a.cgroup is not None and ws.cgroup is not None
        assert set(a.cgroup.pids()).isdisjoint(ws.cgroup.pids())

        # A fork of a filesystem-only copy keeps the record, and a's files.
        (c,) = await a.fork()
        try:
            assert c.fork_mode == "fs" and c.setup == [counter]
            assert await _get(c) == "1 hi"
            assert await c.read_text("/workspace/only-a") == "a"
            assert await c.read_text("/workspace/boots") == "/workspace/srv\n" * 3
        finally:
            await c.aclose()
    finally:
        await a.aclose()
        await b.aclose()


async def test_fs_snapshot_outlives_parent(ws: Workspace) -> None:
    counter = await _start_counter(ws)
    await ws.write_file("/workspace/f", "snap")
    snap = await ws.snapshot()
    async with snap:
        assert snap.mode == "fs" and not record_of(snap).images.exists()
        assert [step for step, _pid in snap.setup] == [counter]
        assert snap.frozen_ms is not None and snap.dump_ms is None
        cg = ws._core.cgroup  # the kernel object: its freezer file
        assert cg is not None and cg.freezer_dir is not None
        assert (cg.freezer_dir / ("freezer.state" if cg.version == 1 else "cgroup.freeze")).read_text().strip() in (
            "THAWED",
            "0",
        )
        assert await _get(ws) == "3 hi"  # thawed and serving
        await ws.aclose()
        copies = await Workspace.from_snapshot(snap, 3)
        try:
            for c in copies:
                assert c.fork_mode == "fs"
                assert (c.limits, c.workdir, c.env, c.hostname) == (ws.limits, ws.workdir, ws.env, ws.hostname)
                assert (await c.exec("hostname")).stdout == f"{ws.hostname}\n"
                assert await c.read_text("/workspace/f") == "snap"
                assert await _get(c) == "1 hi"
        finally:
            for c in copies:
                await c.aclose()


async def test_fs_rollback_restores_files(ws: Workspace) -> None:
    await ws.write_file("/workspace/f", "v1")
    counter = await _start_counter(ws)
    ident, directory, cgroup = ws.id, ws.directory, ws.cgroup
    async with await ws.snapshot() as snap:
        await ws.write_file("/workspace/f", "v2")
        await ws.write_file("/workspace/new", "x")
        await ws.exec("pkill -f counter.py; touch /etc/garbage")
        await ws.rollback(snap)
        assert ws.fork_mode == "fs"
        assert (ws.id, ws.directory, ws.cgroup) == (ident, directory, cgroup)
        assert await ws.read_text("/workspace/f") == "v1"
        assert (await ws.exec("ls /workspace/new /etc/garbage")).exit_code != 0
        assert [p.step for p in ws.restarted_processes] == [counter] and ws.setup == [counter]
        assert await _get(ws) == "1 hi"
        # A second rollback to the same snapshot works too.
        await ws.write_file("/workspace/f", "v3")
        await ws.rollback(snap)
        assert await ws.read_text("/workspace/f") == "v1"
        assert await _get(ws) == "1 hi"
        assert len((await ws.exec("pgrep -f counter.py")).stdout.split()) == 1


@pytest.mark.fork_modes("criu")
async def test_record_survives_criu_copies(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CRIU copy carries the record with its processes; an fs fork of it restarts them."""
    counter = await _start_counter(ws)
    async with await ws.snapshot() as snap:
        assert snap.mode == "criu"
        (live,) = await Workspace.from_snapshot(snap)
        try:
            assert live.fork_mode == "criu" and live.setup == [counter] and live.restarted_processes == []
            assert await _get(live) == "3 hi"  # memory carried
            monkeypatch.setenv("BUNSHIN_FORK_MODE", "fs")
            (cold,) = await live.fork()  # an fs snapshot of a CRIU copy
            (cold2,) = await Workspace.from_snapshot(snap)  # a CRIU snapshot restored in fs mode
            try:
                for c in (cold, cold2):
                    assert c.fork_mode == "fs" and [p.step for p in c.restarted_processes] == [counter]
                    assert await _get(c) == "1 hi"
            finally:
                await cold.aclose()
                await cold2.aclose()
        finally:
            await live.aclose()


async def test_auto_falls_back_without_criu(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "auto")
    monkeypatch.setenv("BUNSHIN_CRIU", "/nonexistent/criu")
    reset_warnings()
    assert _modes.restore_mode() == "fs" and _modes.fs_only()
    why = _criu.criu_unavailable()
    assert why is not None and "/nonexistent/criu" in why
    text, _ok = report()
    assert "MISS fork mode" in text and "CRIU: /nonexistent/criu" in text and "auto gives fs: files only" in text
    await _start_counter(ws)
    for _ in range(2):
        (c,) = await ws.fork()
        try:
            assert c.fork_mode == "fs" and await _get(c) == "1 hi"
        finally:
            await c.aclose()
    warned = [r for r in caplog.records if r.levelname == "WARNING" and r.name == "bunshin_async"]
    assert len(warned) == 1, warned  # one per process, naming what is lost
    assert "criu: " in warned[0].getMessage() and "live fork" in warned[0].getMessage()


def test_criu_unusable_reasons(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = _paths.criu_binary
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "auto")
    monkeypatch.delenv("BUNSHIN_CRIU", raising=False)
    monkeypatch.setattr(_paths, "criu_binary", lambda: None)
    assert "not found" in (_criu.criu_unavailable() or "")
    assert _modes.restore_mode() == "fs"
    broken = tmp_path / "criu"
    broken.write_text("#!/bin/sh\necho 'libfoo.so: cannot open' >&2\nexit 3\n")
    broken.chmod(0o755)
    assert "status 3: libfoo.so: cannot open" in (_criu.criu_unavailable(broken) or "")
    monkeypatch.setattr(_paths, "criu_binary", lambda: broken)
    assert _modes.restore_mode() == "fs"
    for explicit in ("criu", "cow", "ksm"):  # an explicit mode never falls back
        monkeypatch.setenv("BUNSHIN_FORK_MODE", explicit)
        with pytest.raises(CapabilityMissing, match="status 3") as info:
            _modes.fs_only()
        assert info.value.capability == "criu" and "bunshin setup" in info.value.remedy
    monkeypatch.setattr(_paths, "criu_binary", real)
    monkeypatch.setenv("BUNSHIN_FORK_MODE", "fs")
    assert _criu.criu_unavailable() is None  # this host has CRIU: fs is only forced
    assert "ok   fork mode" in report()[0]


async def test_failed_restart_leaves_nothing(ws: Workspace) -> None:
    await ws.exec("mkdir -p /workspace/gone")
    await ws.spawn(["sleep", "1000"], cwd="/workspace/gone")
    await ws.exec("rmdir /workspace/gone")  # the recorded cwd no longer exists in the snapshot's files
    with pytest.raises(ForkError, match="restarting `sleep 1000` failed"):
        await ws.fork(2)
    assert await ws.ping()  # the parent keeps running


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9])
async def test_cancelled_fork_leaves_nothing(ws: Workspace, fraction: float) -> None:
    """Cancelled at a point of the snapshot, the cold start or the restarts: no copy, snapshot or layer is left (the
    root conftest checks) and the parent runs on, thawed."""
    await _start_counter(ws)
    t0 = anyio.current_time()
    for c in await ws.fork(2):
        await c.aclose()
    whole = anyio.current_time() - t0
    with anyio.move_on_after(whole * fraction):
        copies = await ws.fork(2)
        for c in copies:
            await c.aclose()
    assert await _get(ws) == "3 hi"
