"""The user namespace of a workspace (``Security.userns``, on by default): root inside is the unprivileged host range
of ``DEFAULT_IDMAP``, seen from the host, in a workspace and in a live fork of one; files keep the right owners on
both sides; and with every other protection relaxed, the escapes that needed the host's capabilities still fail."""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import pytest

from bunshin_async import Security, Workspace
from bunshin_async._fork._snapshot import record_of
from bunshin_async._host import _kernel, _userns
from bunshin_async._host._userns import DEFAULT_IDMAP, IdMap, shifted

from .conftest import Box, Host, host_root_device, inside

M = DEFAULT_IDMAP


def _ids(pid: int) -> tuple[list[int], list[int]]:
    """Real, effective, saved and filesystem uid and gid of a process, read on the host."""
    lines = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return [int(x) for x in lines["Uid"].split()], [int(x) for x in lines["Gid"].split()]


async def test_every_process_is_the_mapped_uid_on_the_host(box: Box) -> None:
    ws = box.ws
    await ws.spawn(["sleep", "600"])
    await ws.spawn(["sleep", "601"], user="nobody")
    r = await ws.exec("id -u; id -g; cat /proc/self/uid_map /proc/self/gid_map; stat -c '%u %g' /etc/passwd /")
    assert r.stdout.split("\n")[:2] == ["0", "0"], r
    maps = [line.split() for line in r.stdout.splitlines()[2:4]]
    assert maps == [["0", str(M.host_uid), str(M.count)], ["0", str(M.host_gid), str(M.count)]], r
    assert r.stdout.splitlines()[4:] == ["0 0", "0 0"], r  # the image's files show their own owners inside
    assert ws.cgroup is not None
    pids = ws.cgroup.pids()
    assert len(pids) >= 4  # pid 1, the agent, both sleepers (and this exec's shell, maybe gone)
    seen = {}
    for pid in pids:
        try:
            seen[pid] = (Path(f"/proc/{pid}/cmdline").read_bytes(), _ids(pid))
        except FileNotFoundError:  # an exec's process that just ended
            continue
    for cmdline, (uids, gids) in seen.values():
        if cmdline.startswith(b"sleep\x00601"):
            assert uids == [M.uid(65534)] * 4 and gids == [M.gid(65534)] * 4, (cmdline, uids, gids)
        else:
            assert uids == [M.host_uid] * 4 and gids == [M.host_gid] * 4, (cmdline, uids, gids)
        assert 0 not in uids and 0 not in gids
    assert any(c.startswith(b"sleep\x00601") for c, _ in seen.values())
    # The user namespace is the workspace's own: not the host's, and not shared with another workspace.
    assert os.readlink(f"/proc/{ws.pid}/ns/user") != os.readlink("/proc/self/ns/user")
    if box.parent is not None:
        assert box.parent.pid is not None
        assert os.readlink(f"/proc/{ws.pid}/ns/user") != os.readlink(f"/proc/{box.parent.pid}/ns/user")


async def test_a_file_made_by_root_inside_is_owned_by_the_mapped_uid_outside(box: Box) -> None:
    ws = box.ws
    r = await ws.exec("echo x > /root/made && mkdir /workspace/d && chown 1000:1000 /workspace/d && id -u")
    assert r.exit_code == 0 and r.stdout == "0\n", r
    made = os.stat(ws.directory / "upper/root/made")
    assert (made.st_uid, made.st_gid) == (M.host_uid, M.host_gid)
    d = os.stat(ws.directory / "upper/workspace/d")
    assert (d.st_uid, d.st_gid) == (M.uid(1000), M.gid(1000))
    upper = os.stat(ws.directory / "upper")
    assert (upper.st_uid, upper.st_gid) == (M.host_uid, M.host_gid)  # "/" inside is root's
    assert (await ws.exec("stat -c '%u %g' /root/made /workspace/d /")).stdout == "0 0\n1000 1000\n0 0\n"


async def test_nested_user_namespaces_are_denied(box: Box) -> None:
    r = await box.ws.exec("unshare -U -r id -u")
    assert r.exit_code != 0 and "Operation not permitted" in r.stderr, r
    res = await box.attempt("unshare_user")
    assert not res["escaped"] and res["errno"] == "EPERM", res


# With every capability kept, seccomp off, /proc and /sys unmasked and every device allowed, only the user
# namespace stands between these and the host: each needs a capability of the host's user namespace (or its
# ownership of a file), which the mapped root does not have.
RELAXED = msgspec.structs.replace(Security.off(), userns=True)
ROOT_DEV = host_root_device()
NEEDS_HOST_CAPS: list[tuple[str, tuple[object, ...], set[str]]] = [
    ("core_pattern", (), {"EACCES", "EPERM"}),  # a core_pattern pipe runs any program as host root
    ("drop_caches", (), {"EACCES", "EPERM"}),
    ("sysctl", ("vm/swappiness", "@vm/swappiness"), {"EACCES", "EPERM"}),  # (kernel/pid_max is per pid namespace)
    ("sys_write", ("kernel/mm/ksm/run", "@ksm"), {"EROFS"}),  # /sys is read-only (test_sysfs_... remounts it)
    ("mknod", ("/tmp/kmsg", "c", 1, 11), {"EPERM"}),  # the host's kernel log
    ("mknod", ("/tmp/mem", "c", 1, 1), {"EPERM"}),  # physical memory
    ("mount_disk", ROOT_DEV, {"EPERM"}),  # the host's disk
    ("mount_cgroup", (), {"EPERM"}),  # a cgroup v1 hierarchy: move itself out of its limits
    ("clock", (), {"EPERM"}),
    ("settimeofday", (), {"EPERM"}),
    ("open_by_handle_at", (), {"EPERM"}),  # "shocker"
    ("swapon", (), {"EPERM"}),
    ("syslog", (), {"EPERM"}),
]


@pytest.fixture
async def relaxed(where: str) -> AsyncIterator[Box]:
    async with inside(where, security=RELAXED) as box:
        yield box


@pytest.mark.parametrize(
    ("name", "args", "errnos"), NEEDS_HOST_CAPS, ids=[f"{n}-{'-'.join(map(str, a))}" for n, a, _ in NEEDS_HOST_CAPS]
)
async def test_host_capabilities_are_out_of_reach_with_everything_else_relaxed(
    relaxed: Box, host: Host, name: str, args: tuple[object, ...], errnos: set[str]
) -> None:
    status = (await relaxed.ws.exec("grep CapEff /proc/self/status")).stdout.split()
    assert int(status[1], 16) & (1 << 21)  # CAP_SYS_ADMIN is held: over the workspace's own namespaces only
    value = [host.ksm.strip() if a == "@ksm" else host.sysctl(a[1:]) if str(a).startswith("@") else a for a in args]
    res = await relaxed.attempt(name, *value)
    assert not res["escaped"], res
    assert res["errno"] in errnos, res


async def test_sysfs_remounted_writable_still_refuses_host_settings(relaxed: Box, host: Host) -> None:
    ksm = host.ksm.strip()
    r = await relaxed.ws.exec(f"mount -o remount,rw /sys; echo {ksm} > /sys/kernel/mm/ksm/run")
    # sysfs of a net namespace owned by the workspace's user namespace, mounted read-only by pid 1: even with
    # CAP_SYS_ADMIN over it, the remount is refused (and the host's files are the host root's anyway)
    assert r.exit_code != 0 and "/sys: permission denied" in r.stderr and "Read-only file system" in r.stderr, r


async def test_ptrace_of_a_host_process_with_every_capability(relaxed: Box, host: Host) -> None:
    res = await relaxed.attempt("ptrace", host.sentinel.pid)
    assert not res["escaped"] and res["errno"] in {"ESRCH", "EPERM"}, res


async def test_off_is_the_hosts_root(host: Host) -> None:
    async with Workspace(security=Security(userns=False)) as ws:
        assert (await ws.exec("cat /proc/self/uid_map")).stdout.split() == ["0", "0", "4294967295"]
        assert ws.pid is not None and _ids(ws.pid)[0] == [0, 0, 0, 0]
        assert "no user namespace (root inside is the host's root)" in ws.security.relaxations()


def test_shifted_copy_keeps_modes_links_and_capabilities(tmp_path: Path) -> None:
    src = tmp_path / "layer"
    (src / "bin").mkdir(parents=True)
    tool = src / "bin/tool"
    tool.write_bytes(b"#!/bin/sh\n")
    os.chmod(tool, 0o4755)  # setuid: chown(2) clears it, the shift must put it back
    os.link(tool, src / "bin/hard")
    os.symlink("tool", src / "bin/soft")
    big = src / "big"
    big.write_text("x")
    os.chown(big, 70000, 5)  # beyond the range: the overflow id
    os.setxattr(tool, "security.capability", (0x02000001).to_bytes(4, "little") + bytes(16))
    idmap = IdMap(host_uid=200000, host_gid=300000, count=65536)
    dst = shifted(src, idmap)
    assert dst.parent == tmp_path and dst.name.startswith(f"layer{idmap.suffix}-") and dst.is_dir()
    st = os.lstat(dst / "bin/tool")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777, st.st_nlink) == (200000, 300000, 0o4755, 2)
    assert os.lstat(dst / "bin/hard").st_ino == st.st_ino
    link = os.lstat(dst / "bin/soft")
    assert (link.st_uid, link.st_gid, os.readlink(dst / "bin/soft")) == (200000, 300000, "tool")
    assert (os.stat(dst / "big").st_uid, os.stat(dst / "big").st_gid) == (200000 + 65534, 300005)
    caps = os.getxattr(dst / "bin/tool", "security.capability")
    assert len(caps) == 24 and caps[3] == 3 and int.from_bytes(caps[20:], "little") == 200000  # v3, rooted
    assert os.stat(src / "bin/tool").st_uid == 0  # the source is untouched
    assert shifted(src, idmap) == dst and os.lstat(dst / "bin/tool").st_ino == st.st_ino  # made once
    os.rename(src, tmp_path / "old")  # a replaced source gets a new copy; the old one is left for gc
    (tmp_path / "layer").mkdir()
    (tmp_path / "layer/new").write_text("y")
    again = shifted(tmp_path / "layer", idmap)
    assert again != dst and dst.is_dir()
    assert sorted(os.listdir(again)) == ["new"] and os.stat(again / "new").st_uid == 200000


async def test_concurrent_first_users_make_one_copy(tmp_path: Path) -> None:
    src = tmp_path / "layer"
    src.mkdir()
    for i in range(200):
        (src / f"f{i}").write_text(str(i))
    idmap = IdMap(host_uid=200000, host_gid=200000, count=65536)
    made: list[Path] = []

    async def one() -> None:
        made.append(await anyio.to_thread.run_sync(shifted, src, idmap))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    assert len(set(made)) == 1 and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["layer", made[0].name, f".{made[0].name}.lock"]
    )


def _root_lower(pid: int) -> list[str]:
    """The lower dirs of the overlay that is pid's root, from its mountinfo."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/" and " - overlay " in line:
            opts = dict(o.partition("=")[::2] for o in line.rsplit(" ", 1)[1].split(","))
            return opts["lowerdir"].split(":")
    raise AssertionError(f"no overlay root for {pid}")


async def test_workspaces_share_one_shifted_copy_of_each_layer() -> None:
    async with Workspace() as a, Workspace() as b:
        assert a.pid is not None and b.pid is not None
        lower = _root_lower(a.pid)
        assert lower == _root_lower(b.pid) and len(lower) == 2  # the agent layer and the base image
        for layer in lower:
            assert M.suffix in os.path.basename(layer), layer
            assert os.stat(layer).st_uid == M.host_uid


def _owner_of(pid: int, ns: str) -> int:
    """The inode of the user namespace that owns the ``ns`` namespace of ``pid`` (ioctl_ns(2), NS_GET_USERNS)."""
    fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY)
    try:
        owner = fcntl.ioctl(fd, 0xB701)  # _IO(0xb7, 0x1)
    finally:
        os.close(fd)
    try:
        return os.fstat(owner).st_ino
    finally:
        os.close(owner)


async def test_a_copy_gets_a_fresh_loopback_owned_by_its_own_user_namespace() -> None:
    async with Workspace() as ws:
        await ws.spawn(["python3", "-m", "http.server", "--bind", "127.0.0.1", "8000"], log_path="http.log")
        get = "python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:8000/\").status)'"
        with anyio.fail_after(30):
            while (await ws.exec(get)).stdout != "200\n":
                await anyio.sleep(0.05)
        async with await ws.snapshot() as snap:
            assert record_of(snap).fresh_net  # loopback only: left out of the images, made anew for each copy
            (copy,) = await Workspace.from_snapshot(snap)
            try:
                assert ws.pid is not None and copy.pid is not None
                for pid in (ws.pid, copy.pid):
                    for ns in ("net", "mnt", "pid", "ipc", "uts"):
                        assert _owner_of(pid, ns) == os.stat(f"/proc/{pid}/ns/user").st_ino, (pid, ns)
                assert os.readlink(f"/proc/{copy.pid}/ns/net") != os.readlink(f"/proc/{ws.pid}/ns/net")
                assert (await copy.exec(get)).stdout == "200\n"  # the carried listener, on the copy's own loopback
                assert (await copy.exec("cat /sys/class/net/lo/operstate; ls /sys/class/net")).stdout == "unknown\nlo\n"
            finally:
                await copy.aclose()


def test_gc_removes_stale_and_partial_shifted_copies_only(tmp_path: Path) -> None:
    idmap = IdMap(host_uid=200000, host_gid=200000, count=65536)
    copies = {}
    for name in ("kept", "replaced", "gone", "busy"):
        (tmp_path / name).mkdir()
        copies[name] = shifted(tmp_path / name, idmap)
    for name in ("replaced", "busy", "gone"):
        os.rename(tmp_path / name, tmp_path / f"{name}-old")
    for name in ("replaced", "busy"):
        (tmp_path / name).mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    for token, name in ((f"{dead.pid} 1", "dead"), (_kernel.owner_token(os.getpid()), "live")):
        partial = tmp_path / f".{name}{idmap.suffix}-0123456789ab.tmp-0000"
        partial.mkdir()
        partial.with_name(partial.name + ".owner").write_text(token)
    busy = str(copies["busy"])
    out = _userns.collect([tmp_path], {busy})
    left = sorted(p.name for p in tmp_path.iterdir() if ".shift-" in p.name and not p.name.endswith(".lock"))
    live = f".live{idmap.suffix}-0123456789ab.tmp-0000"
    assert left == sorted([live, f"{live}.owner", copies["busy"].name, copies["kept"].name]), out
    assert f"kept stale shifted copy {busy} (mounted by a live workspace)" in out, out
    assert sorted(line for line in out if line.startswith("removed")) == sorted(
        [
            f"removed stale shifted copy {copies['replaced']}",
            f"removed stale shifted copy {copies['gone']}",
            f"removed partial shifted copy {tmp_path}/.dead{idmap.suffix}-0123456789ab.tmp-0000",
        ]
    ), out
    locks = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".lock"))
    assert locks == sorted(f".{copies[n].name}.lock" for n in ("kept", "busy")), locks
