"""``user=``: commands, background processes and shells run as a user of the image, resolved from its /etc/passwd
and /etc/group by the agent (no NSS), with setgroups/setgid/setuid before the exec."""

from __future__ import annotations

import pytest

from bunshin_async import Image, InvalidArgument, Workspace


async def test_names_uids_and_groups(busybox_image: Image) -> None:
    async with Workspace(image=busybox_image) as ws:
        assert (await ws.exec("id -u; id -g")).stdout == "0\n0\n"
        r = await ws.exec("id -u; id -g; id -G; echo $HOME", user="alice")
        assert r.stdout == "1500\n1500\n1500 1600 1700\n/home/alice\n"
        r = await ws.exec(["id", "-u"], user="1500")  # a uid the image knows: its group and home too
        assert r.stdout == "1500\n"
        assert (await ws.exec("id -G; echo $HOME", user="1500")).stdout == "1500 1600 1700\n/home/alice\n"
        assert (await ws.exec("id -u; id -g; id -G", user="4321:8765")).stdout == "4321\n8765\n8765\n"
        assert (await ws.exec("id -u; id -G", user="4321")).stdout == "4321\n0\n"  # unknown uid: gid 0
        assert (await ws.exec("id -u; id -G", user="alice:devs")).stdout == "1500\n1600\n"  # explicit group only
        assert (await ws.exec("id -g", user="alice:42")).stdout == "42\n"
        assert (await ws.exec("echo $HOME", user="alice", env={"HOME": "/elsewhere"})).stdout == "/elsewhere\n"
        for bad in ("mallory", "alice:nosuchgroup", "", ":1", "1:", "a:b:c", "99999999999"):
            with pytest.raises(InvalidArgument):
                await ws.exec("true", user=bad)
        # A non-root user cannot reach the agent: its socket directory is root's, mode 0700.
        r = await ws.exec("ls /run/bunshin/ 2>&1; echo x > /run/bunshin/f 2>&1 || echo denied", user="alice")
        assert "Permission denied" in r.stdout and "denied" in r.stdout
        assert (await ws.exec("touch /workspace/f", user="alice")).exit_code != 0  # root's 0755 workdir


async def test_workspace_default_and_overrides(busybox_image: Image) -> None:
    async with Workspace(image=busybox_image, user="alice") as ws:
        assert (await ws.exec("id -u")).stdout == "1500\n"
        assert (await ws.exec("id -u", user="root")).stdout == "0\n"
        async with ws.shell() as sh:
            assert (await sh.run("id -u; cd /tmp; echo $HOME")).stdout == "1500\n/home/alice\n"
        async with ws.shell(user="0") as sh:
            assert (await sh.run("id -u")).stdout == "0\n"
        proc = await ws.spawn("sleep 1000")
        assert (await ws.exec(f"stat -c %u /proc/{proc.pid}")).stdout == "1500\n"
        root_proc = await ws.spawn("sleep 1000", user="root")
        assert (await ws.exec(f"stat -c %u /proc/{root_proc.pid}")).stdout == "0\n"
        await proc.kill()
        await root_proc.kill()
        copies = await ws.fork(1)  # the default user forks with the workspace
        try:
            assert copies[0].user == "alice"
            assert (await copies[0].exec("id -u")).stdout == "1500\n"
        finally:
            await copies[0].aclose()


async def test_user_on_the_debian_image() -> None:
    async with Workspace() as ws:
        r = await ws.exec(["id"], user="nobody")
        assert r.stdout == "uid=65534(nobody) gid=65534(nogroup) groups=65534(nogroup)\n"
        async with ws.shell(user="nobody") as sh:
            assert sh.path == "/bin/bash"
            assert (await sh.run("whoami")).stdout == "nobody\n"


async def test_a_user_name_or_home_too_long_is_refused_not_cut() -> None:
    """/etc/passwd is the workspace's: a name longer than the agent's buffer would, cut, match another user's
    groups, and a home longer than PATH_MAX would become another directory. Both are refused."""
    long_name, short = "u" * 300, "u" * 255
    home = "/" + "/".join(["h" * 200] * 25)
    async with Workspace() as ws:
        append = "import sys; open(sys.argv[1], 'a').write(sys.argv[2])"
        passwd = f"{long_name}:x:1600:1600::/:/bin/sh\nfar:x:1601:1601::{home}:/bin/sh\n"
        assert (await ws.exec(["python3", "-c", append, "/etc/passwd", passwd])).ok
        assert (await ws.exec(["python3", "-c", append, "/etc/group", f"g1:x:4242:{short}\n"])).ok
        with pytest.raises(InvalidArgument, match="longer than"):
            await ws.exec(["id", "-G"], user=long_name)
        with pytest.raises(InvalidArgument, match="longer than PATH_MAX"):
            await ws.exec(["true"], user="far")
        assert (await ws.exec(["id", "-G"], user="1777")).stdout == "0\n"  # an unknown uid still runs
