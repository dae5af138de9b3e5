"""``bunshin-init --restore-wrap`` (``_fork._restore._wrapper``), the process every CRIU restore runs through: it
must build the restore's private namespaces and root exactly, leave nothing on the host, and fail loudly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bunshin_async import Security, Workspace
from bunshin_async._host import _paths

pytestmark = pytest.mark.fork_modes("criu-cow")  # no restore mode involved: run once

PROBE = (
    "readlink /proc/self/fd/9 /proc/self/ns/net; grep -c ' {root} ' /proc/self/mountinfo; cat {root}/hello; "
    "cat /proc/sys/net/ipv4/tcp_ehash_entries; ip -o link show | cut -d' ' -f2,3"
)
CHILD_EHASH = "16384"  # native/init.c: the TCP hash table of a workspace's own net namespace
HOST_CHILD_EHASH = Path("/proc/sys/net/ipv4/tcp_child_ehash_entries")


def _dirs(tmp_path: Path) -> dict[str, Path]:
    d = {name: tmp_path / name for name in ("lower", "upper", "work", "root")}
    for p in d.values():
        p.mkdir()
    (d["lower"] / "hello").write_text("from-lower\n")
    return d


def _wrap(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_paths.init_binary()), "--restore-wrap", *args], capture_output=True, text=True, timeout=30
    )


def test_private_mount_and_fresh_net(tmp_path: Path) -> None:
    d = _dirs(tmp_path)
    opts = f"lowerdir={d['lower']},upperdir={d['upper']},workdir={d['work']}"
    r = _wrap("--net", "--overlay", opts, "--root", str(d["root"]), "--", "/bin/sh", "-c", PROBE.format(root=d["root"]))
    assert r.returncode == 0, r.stderr
    fd9, own_net, mounted, hello, ehash, *links = r.stdout.split()
    assert fd9 == own_net != os.readlink("/proc/self/ns/net")  # CRIU inherits the new namespace on fd 9
    assert (mounted, hello) == ("1", "from-lower")
    assert ehash == CHILD_EHASH  # a table of its own (a negative size: the host's, shared)
    assert links[0] == "lo:" and "UP" in links[1].split(",") and len(links) == 2  # loopback only, up
    assert not os.listdir(d["root"])  # the overlay lived only in the wrapper's mount namespace
    assert f" {d['root']} " not in Path("/proc/self/mountinfo").read_text()


def test_without_net_runs_in_a_namespace_whose_children_get_small_tables(tmp_path: Path) -> None:
    """Without --net CRIU makes the copy's net namespace itself (criu/patches/0011) or restores the one in the
    images: the wrapper leaves it in an intermediate namespace whose children get a small TCP table, and the host's
    setting is untouched."""
    d = _dirs(tmp_path)
    opts = f"lowerdir={d['lower']},upperdir={d['upper']},workdir={d['work']}"
    host = HOST_CHILD_EHASH.read_text()
    probe = f"readlink /proc/self/ns/net; cat {HOST_CHILD_EHASH}; unshare -n cat /proc/sys/net/ipv4/tcp_ehash_entries"
    r = _wrap("--overlay", opts, "--root", str(d["root"]), "--", "/bin/sh", "-c", probe)
    assert r.returncode == 0, r.stderr
    net, child_ehash, made = r.stdout.split()
    assert net != os.readlink("/proc/self/ns/net") and child_ehash == made == CHILD_EHASH
    assert HOST_CHILD_EHASH.read_text() == host


SERVE = (
    'python3 -c \'import socket; s = socket.create_server(("127.0.0.1", 0)); c = socket.create_connection('
    's.getsockname()); a, _ = s.accept(); c.sendall(b"pong"); print(a.recv(4).decode())\''
)


@pytest.mark.parametrize("userns", [True, False], ids=["userns", "no-userns"])
async def test_workspaces_and_copies_have_their_own_tcp_table(userns: bool) -> None:
    """CRIU's socket collection walks the TCP table of the dumped namespace at every dump: a workspace's, a copy's
    and a copy of a copy's are small ones of their own, not the host's."""
    host = HOST_CHILD_EHASH.read_text()
    probe = "cat /proc/sys/net/ipv4/tcp_ehash_entries"
    async with Workspace(security=Security(userns=userns)) as ws:
        [c] = await ws.fork()
        try:
            [d] = await c.fork()
            try:
                for w in (ws, c, d):
                    assert (await w.exec(probe)).stdout.strip() == CHILD_EHASH
                served = await d.exec(SERVE, timeout=30)
                assert served.stdout.strip() == "pong", served.stderr
            finally:
                await d.aclose()
        finally:
            await c.aclose()
    assert HOST_CHILD_EHASH.read_text() == host


def test_failures_are_reported_on_stderr(tmp_path: Path) -> None:
    d = _dirs(tmp_path)
    r = _wrap("--overlay", f"lowerdir={tmp_path}/missing", "--root", str(d["root"]), "--", "/bin/true")
    assert r.returncode == 1 and r.stderr.startswith("E mount overlay on "), r.stderr
    opts = f"lowerdir={d['lower']},upperdir={d['upper']},workdir={d['work']}"
    r = _wrap("--overlay", opts, "--root", str(d["root"]), "--", str(tmp_path / "no-such-criu"))
    assert r.returncode == 1 and "no-such-criu: No such file or directory" in r.stderr
    r = _wrap("--cgroup", str(tmp_path / "no-cgroup"), "--overlay", opts, "--root", str(d["root"]), "--", "/bin/true")
    assert r.returncode == 1 and "no-cgroup: No such file or directory" in r.stderr
    for bad in ([], ["--overlay", opts, "--root", str(d["root"])], ["--bogus", "--", "/bin/true"]):
        r = _wrap(*bad)
        assert r.returncode == 1 and "usage: bunshin-init --restore-wrap" in r.stderr
    assert not os.listdir(d["root"])


def test_mount_roots_on_a_tmpfs_of_the_restore_alone(tmp_path: Path) -> None:
    """``--mnt-roots DIR``: CRIU (criu/patches/0037) is told to make its mount roots in DIR, a tmpfs of the
    wrapper's mount namespace that the restored root, mapped in its user namespace, can walk through; what CRIU
    leaves there (a restore killed or failed) is never on the host."""
    d = _dirs(tmp_path)
    roots = tmp_path / "roots"  # made by the wrapper
    opts = f"lowerdir={d['lower']},upperdir={d['upper']},workdir={d['work']}"
    probe = 'r=$CRIU_MNT_ROOTS; echo "$r"; stat -f -c %T "$r"; stat -c %a "$r"; mkdir "$r/x"'
    r = _wrap("--mnt-roots", str(roots), "--overlay", opts, "--root", str(d["root"]), "--", "/bin/sh", "-c", probe)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(roots), "tmpfs", "711"]
    assert roots.is_dir() and not os.listdir(roots)  # the mkdir went to the wrapper's tmpfs
    assert f" {roots} " not in Path("/proc/self/mountinfo").read_text()


def test_mount_roots_must_be_a_root_owned_directory(tmp_path: Path) -> None:
    d = _dirs(tmp_path)
    opts = f"lowerdir={d['lower']},upperdir={d['upper']},workdir={d['work']}"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 1000, 1000)
    link = tmp_path / "link"
    link.symlink_to(d["upper"])
    for bad, why in ((theirs, "Operation not permitted"), (link, "Not a directory")):
        r = _wrap("--mnt-roots", str(bad), "--overlay", opts, "--root", str(d["root"]), "--", "/bin/true")
        assert r.returncode == 1 and f"{bad}: {why}" in r.stderr, r.stderr
    assert f" {d['upper']} " not in Path("/proc/self/mountinfo").read_text()
