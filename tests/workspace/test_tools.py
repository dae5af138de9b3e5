"""Tools on a real workspace: exec, persistent shells, files, background processes."""

from __future__ import annotations

import signal

import anyio
import pytest

from bunshin_async import (
    ExecResult,
    FileNotFound,
    InvalidArgument,
    PathOutsideWorkspace,
    ToolTimeout,
    Workspace,
)


@pytest.fixture
async def ws():  # type: ignore[no-untyped-def]
    async with Workspace() as w:
        yield w


async def test_exec_string_argv_stdin_env_cwd(ws: Workspace) -> None:
    r = await ws.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.truncated) == (3, "out\n", "err\n", False)
    assert isinstance(r, ExecResult) and r.duration > 0 and not r.ok
    r = await ws.exec(["printf", "%s|", "a b", "c"])
    assert r.stdout == "a b|c|" and r.ok
    assert (await ws.exec("cat", stdin="piped\n")).stdout == "piped\n"
    assert (await ws.exec("echo $FOO", env={"FOO": "bar"})).stdout == "bar\n"
    assert (await ws.exec("pwd")).stdout == "/workspace\n"
    assert (await ws.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"
    big = bytes(range(256)) * 4096  # 1 MiB of stdin, more than a pipe buffer
    r = await ws.exec("wc -c", stdin=big)
    assert r.stdout.strip() == str(len(big))


async def test_exec_signal_exit_code(ws: Workspace) -> None:
    r = await ws.exec("kill -9 $$")
    assert r.exit_code == 128 + signal.SIGKILL


async def test_exec_returns_while_background_child_holds_pipes(ws: Workspace) -> None:
    r = await ws.exec("sleep 30 & echo started", timeout=10)
    assert r.stdout == "started\n" and r.duration < 5


async def test_exec_bad_input(ws: Workspace) -> None:
    with pytest.raises(FileNotFound):
        await ws.exec(["/no/such/binary"])
    with pytest.raises(FileNotFound):
        await ws.exec("true", cwd="/no/such/dir")
    with pytest.raises(InvalidArgument):
        await ws.exec([])
    with pytest.raises(InvalidArgument):
        await ws.exec("true", timeout=0)
    with pytest.raises(InvalidArgument):
        await ws.exec("echo \0")
    assert (await ws.exec("true")).ok  # the workspace survives bad input


async def test_timeout_keeps_partial_output_and_kills_the_group(ws: Workspace) -> None:
    with pytest.raises(ToolTimeout) as info:
        await ws.exec("echo started; sleep 1000 & sleep 1000", timeout=0.5)
    assert info.value.stdout == "started\n" and info.value.timeout == 0.5 and info.value.tool == "exec"
    ps = await ws.exec("ps -eo comm")
    assert "sleep" not in ps.stdout


async def test_output_flood_is_capped(ws: Workspace) -> None:
    r = await ws.exec("head -c 1000000000 /dev/zero | tr '\\0' a; echo done >&2", timeout=120)
    assert r.truncated and r.exit_code == 0
    assert len(r.stdout) == ws.max_output and set(r.stdout) == {"a"}
    assert r.stderr == "done\n"


async def test_shell_keeps_cwd_env_and_variables(ws: Workspace) -> None:
    async with ws.shell() as sh:
        await sh.run("mkdir -p /tmp/d && cd /tmp/d")
        await sh.run("export EXPORTED=1; plain=2")
        r = await sh.run('pwd; echo "$EXPORTED$plain"; bash -c \'echo "${EXPORTED}x${plain}"\'')
        assert r.stdout == "/tmp/d\n12\n1x\n"
        r = await sh.run("cat <<'EOF'\nit's a \"heredoc\" $plain\nEOF\nfalse")
        assert r.stdout == 'it\'s a "heredoc" $plain\n' and r.exit_code == 1
        r = await sh.run("printf 'no newline'; echo e >&2")
        assert (r.stdout, r.stderr) == ("no newline", "e\n")
        with pytest.raises(ToolTimeout) as info:
            await sh.run("echo before; sleep 1000", timeout=0.5)
        assert info.value.stdout == "before\n"
        assert (await sh.run("pwd; echo $plain")).stdout == "/tmp/d\n2\n"  # the session survived
        r = await sh.run("exit 4")
        assert r.exit_code == 4
        with pytest.raises(InvalidArgument):
            await sh.run("true")


async def test_shells_are_independent(ws: Workspace) -> None:
    async with ws.shell() as a, ws.shell() as b:
        await a.run("cd /tmp; X=a")
        assert (await b.run("pwd; echo ${X:-unset}")).stdout == "/workspace\nunset\n"


async def test_a_shell_call_cancelled_while_queued_never_runs(ws: Workspace) -> None:
    """A session runs one command at a time: a call queued behind a running one and cancelled meanwhile must not
    run when that one ends (the agent waited for the session's lock without watching the connection: the command
    ran after its cancellation, and the agent's pool thread stayed stuck behind the lock until then). The call is
    cancelled once the agent reports it waiting for the session's lock (``agent_info().waiting``), and the
    cancellation returns once the agent let it go."""
    hold = "touch /tmp/started; while [ ! -e /tmp/go ]; do sleep 0.05; done"
    async with ws.shell() as sh:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sh.run, hold)
            with anyio.fail_after(60):  # a hang guard: the first command runs
                while (await ws.exec("test -e /tmp/started")).exit_code:  # noqa: ASYNC110 - polls the guest
                    await anyio.sleep(0.02)
            async with anyio.create_task_group() as queued:
                queued.start_soon(sh.run, "touch /tmp/queued")
                with anyio.fail_after(60):  # a hang guard: the call reaches the agent and waits behind the first
                    while (await ws.agent_info()).waiting != 1:  # noqa: ASYNC110 - polls the agent
                        await anyio.sleep(0.02)
                queued.cancel_scope.cancel()
            assert (await ws.agent_info()).waiting == 0  # the agent let it go before the cancellation returned
            await ws.exec("touch /tmp/go")
        assert (await sh.run("echo ok")).stdout == "ok\n"  # the session lives on; the queued call had its turn
        assert (await sh.run("true")).exit_code == 0
    assert (await ws.exec("test -e /tmp/queued")).exit_code == 1


async def test_files_roundtrip_and_listing(ws: Workspace) -> None:
    blob = bytes(range(256)) * 100
    await ws.write_file("sub/dir/blob.bin", blob)
    assert await ws.read_file("sub/dir/blob.bin") == blob
    assert await ws.read_file("/workspace/sub/dir/blob.bin", max_bytes=10) == blob[:10]
    await ws.write_file("t.txt", "one\n")
    await ws.write_file("t.txt", "two\n", append=True)
    assert await ws.read_text("t.txt") == "one\ntwo\n"
    assert (await ws.exec("cat sub/dir/blob.bin | wc -c")).stdout.strip() == str(len(blob))
    await ws.write_file("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert (await ws.exec(["./run.sh"])).stdout == "ran\n"
    names = {(e.name, e.kind) for e in await ws.list_dir()}
    assert {("sub", "dir"), ("t.txt", "file"), ("run.sh", "file")} <= names
    await ws.remove("t.txt")
    with pytest.raises(FileNotFound):
        await ws.read_file("t.txt")
    with pytest.raises(InvalidArgument):
        await ws.remove("sub")  # not empty, not recursive
    await ws.remove("sub", recursive=True)
    assert {e.name for e in await ws.list_dir()} == {"run.sh"}


async def test_paths_outside_the_workspace_are_refused(ws: Workspace) -> None:
    await ws.exec("ln -s /etc escape; ln -s ../workspace/inside.txt ok; echo hi > inside.txt")
    for bad in ("../etc/passwd", "/etc/passwd", "a/../../etc/passwd", "escape/passwd", "escape"):
        with pytest.raises(PathOutsideWorkspace) as info:
            await ws.read_file(bad)
        assert info.value.path == bad
    with pytest.raises(PathOutsideWorkspace):
        await ws.write_file("escape/evil", "x")
    with pytest.raises(PathOutsideWorkspace):
        await ws.list_dir("..")
    with pytest.raises(PathOutsideWorkspace):
        await ws.remove("../etc/hostname")
    assert await ws.read_text("ok") == "hi\n"  # a symlink that stays inside is fine
    await ws.remove("escape")  # removes the link itself, not its target
    assert (await ws.exec("test -f /etc/passwd")).ok


async def test_background_process_outlives_calls(ws: Workspace) -> None:
    proc = await ws.spawn("echo up; sleep 1000", log_path="bg.log")
    assert await proc.poll() is None
    await ws.exec("true")
    assert await proc.poll() is None
    assert "sleep 1000" in (await ws.exec("ps -eo args")).stdout
    assert (await ws.read_text("bg.log")) == "up\n"
    await proc.kill()
    for _ in range(200):
        if await proc.poll() is not None:
            break
        await anyio.sleep(0.01)
    assert await proc.poll() == 128 + signal.SIGKILL
