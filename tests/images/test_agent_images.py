"""Images the static C agent makes possible: the config's User, an image with no Python at all, and Debian 13 with
python3.13 (the agent no longer runs on the image's python3.11). Each forks live with its processes and memory."""

from __future__ import annotations

import os
from pathlib import Path

from bunshin_async import Image, Workspace

from .test_images import _read_when, assert_forks_with_state


async def test_b_user_of_the_config(user_image: Image) -> None:
    async with Workspace(user_image) as ws:
        assert ws.user == "app"
        r = await ws.exec("id -un; pwd; echo $VAR")
        assert r.stdout == "app\n/testbed\nhello from the image\n", r
        assert (await ws.exec("id -un", user="root")).stdout == "root\n"  # a call's user wins
        async with ws.shell() as sh:
            assert (await sh.run("id -u; echo $HOME")).stdout == "1234\n/home/app\n"
        await ws.start_entrypoint()
        assert (await _read_when(ws, "/testbed/entry.log")).startswith("started as app in /testbed")
        await assert_forks_with_state(ws)
        (copy,) = await ws.fork(1)
        try:
            assert copy.user == "app" and (await copy.exec("id -un")).stdout == "app\n"
        finally:
            await copy.aclose()
    async with Workspace(user_image, user="0") as ws:  # the workspace's own user wins over the image's
        assert (await ws.exec("id -un; pwd")).stdout == "root\n/testbed\n"


async def test_c_image_without_python(nopython_image: Image) -> None:
    for layer in nopython_image.layers[:1]:  # the top layer deletes what the base has
        assert os.path.lexists(Path(layer) / "usr/bin/python3")  # as a whiteout
    async with Workspace(nopython_image) as ws:
        r = await ws.exec("ls /usr/bin | grep -c '^python' ; ls -d /usr/lib/python3* 2>&1; echo done")
        assert r.stdout.splitlines()[0] == "0" and "No such file" in r.stdout and r.stdout.endswith("done\n"), r
        await ws.write_file("hello.txt", "no python needed\n")
        assert (await ws.read_text("hello.txt")) == "no python needed\n"
        await assert_forks_with_state(ws)


async def test_d_debian_13_workspace_with_python_3_13(trixie_image: Image) -> None:
    async with Workspace(trixie_image) as ws:
        r = await ws.exec("cat /etc/debian_version; python3 -c 'import sys; print(sys.version_info[:2])'")
        assert r.stdout.startswith("13.") and r.stdout.endswith("(3, 13)\n"), r
        await ws.spawn(["python3", "-c", "import time; x = bytearray(64 << 20); time.sleep(1e6)"])
        await assert_forks_with_state(ws)
