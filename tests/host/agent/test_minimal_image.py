"""A workspace on an image with no Python, no bash and no shared library (only static busybox): the agent needs
nothing from it; exec, files, shells, background processes and a live fork all work, and /bin/sh is what command
strings run through (and the results say so)."""

from __future__ import annotations

import signal

import anyio
import pytest

from bunshin_async import FileNotFound, Image, PathOutsideWorkspace, ToolTimeout, Workspace


async def test_exec_files_and_shell_without_python_or_bash(busybox_image: Image) -> None:
    async with Workspace(image=busybox_image) as ws:
        assert (await ws.agent_info()).shell == "/bin/sh"
        assert (await ws.exec("test -e /usr/bin/python3 || test -e /bin/bash || echo none")).stdout == "none\n"
        r = await ws.exec("echo out; echo err >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr, r.shell) == (3, "out\n", "err\n", "/bin/sh")
        r = await ws.exec(["printf", "%s|", "a b", "c"])
        assert (r.stdout, r.shell) == ("a b|c|", None)
        assert (await ws.exec("cat", stdin="piped\n")).stdout == "piped\n"
        assert (await ws.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"
        assert (await ws.exec("echo $FOO", env={"FOO": "bar"})).stdout == "bar\n"

        blob = bytes(range(256)) * 64
        await ws.write_file("d/blob.bin", blob)
        assert await ws.read_file("d/blob.bin") == blob
        assert (await ws.exec("wc -c < d/blob.bin")).stdout.strip() == str(len(blob))
        assert [(e.name, e.kind) for e in await ws.list_dir("d")] == [("blob.bin", "file")]
        with pytest.raises(PathOutsideWorkspace):
            await ws.read_file("../etc/passwd")
        await ws.remove("d", recursive=True)
        with pytest.raises(FileNotFound):
            await ws.read_file("d/blob.bin")

        async with ws.shell() as sh:
            assert sh.path == "/bin/sh"
            await sh.run("cd /tmp && X=1 && export Y=2")
            r = await sh.run('pwd; echo $X$Y; it="it\'s"; echo "$it"')
            assert (r.stdout, r.shell) == ("/tmp\n12\nit's\n", "/bin/sh")
            with pytest.raises(ToolTimeout) as info:
                await sh.run("echo before; sleep 1000", timeout=0.5)
            assert info.value.stdout == "before\n"
            assert (await sh.run("echo $X")).stdout == "1\n"

        with pytest.raises(ToolTimeout):
            await ws.exec("sleep 1000 & sleep 1000", timeout=0.5)
        assert "sleep" not in (await ws.exec("ps -o comm")).stdout

        proc = await ws.spawn("echo up; exec sleep 1000", log_path="bg.log")
        with anyio.fail_after(10):  # the kill must not race the echo
            while (await ws.exec("cat bg.log")).stdout != "up\n":
                await anyio.sleep(0.01)
        assert await proc.poll() is None
        await proc.kill()
        with anyio.fail_after(10):
            while await proc.poll() is None:
                await anyio.sleep(0.01)
        assert await proc.poll() == 128 + signal.SIGKILL
        assert await ws.read_text("bg.log") == "up\n"


async def test_fork_without_python_or_bash(busybox_image: Image) -> None:
    async with Workspace(image=busybox_image) as ws:
        await ws.write_file("state", "parent\n")
        counter = await ws.spawn("i=0; while true; do i=$((i+1)); echo $i > n; sleep 0.05; done")
        async with ws.shell() as sh:
            await sh.run("cd /tmp; V=kept")
            copies = await ws.fork(2)
            try:
                for c in copies:
                    assert c.fork_mode.startswith("criu")
                    assert await c.read_text("state") == "parent\n"
                    # the loop runs on in the copy: its counter moves (a `ps` may catch it between two sleeps)
                    first = int((await c.exec(["sh", "-c", "cat n"])).stdout or 0)  # empty: caught mid-write
                    with anyio.fail_after(10):
                        while int((await c.exec(["sh", "-c", "cat n"])).stdout or 0) <= first:  # noqa: ASYNC110
                            await anyio.sleep(0.05)
                    await c.write_file("state", c.id)
                assert await ws.read_text("state") == "parent\n"
                assert (await sh.run("pwd; echo $V")).stdout == "/tmp\nkept\n"  # the parent's session is untouched
            finally:
                for c in copies:
                    await c.aclose()
        await counter.kill()


async def test_an_image_without_any_shell(no_shell_image: Image) -> None:
    async with Workspace(image=no_shell_image) as ws:
        assert (await ws.agent_info()).shell is None
        with pytest.raises(FileNotFound, match="no shell"):
            await ws.exec("echo hi")
        with pytest.raises(FileNotFound, match="no shell"):
            async with ws.shell():
                pass
        assert (await ws.exec(["echo", "argv works"])).stdout == "argv works\n"
        await ws.write_file("f", "x")
        assert await ws.read_text("f") == "x"
