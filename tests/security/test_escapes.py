"""Escape attempts from inside a workspace and from inside a live fork of one, each run as root (the workspace's
root is the host's uid 0, with the boundary of ``Security()``), each asserted to fail with the host unchanged
(``host``: sysctls, mount table, clock, a host process alive and untraced)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bunshin_async import BunshinError, Limits
from bunshin_async._host._kernel import mount_options

from .conftest import Box, Host, host_root_device, inside

EPERM, EROFS, EACCES = "EPERM", "EROFS", "EACCES"

ROOT_DEV = host_root_device()

# name, arguments, the errno(s) it must fail with
BLOCKED: list[tuple[str, tuple[object, ...], set[str]]] = [
    ("core_pattern", (), {EROFS}),  # a core_pattern pipe runs any program as host root
    ("drop_caches", (), {EROFS}),
    ("sysctl", ("vm/swappiness", "@vm/swappiness"), {EROFS}),  # the value it already has: harmless if it worked
    ("sysctl", ("kernel/pid_max", "@kernel/pid_max"), {EROFS}),
    ("sys_write", ("kernel/mm/ksm/run", "@ksm"), {EROFS}),
    ("remount_proc_sys", (), {EPERM}),
    ("mount_proc", (), {EPERM}),
    ("mount_sysfs", (), {EPERM}),
    ("mount_tmpfs_root", (), {EPERM}),
    ("mount_cgroup", (), {EPERM}),
    ("mount_cgroup2", (), {EPERM}),
    ("mount_disk", ROOT_DEV, {EPERM}),
    ("mknod", ("/tmp/kmsg", "c", 1, 11), {EPERM}),  # the host's kernel log
    ("mknod", ("/tmp/mem", "c", 1, 1), {EPERM}),  # physical memory
    ("mknod", ("/tmp/blk", "b", *ROOT_DEV), {EPERM}),  # the host's disk
    ("af_packet", (), {EPERM}),
    ("raw_socket", (), {EPERM}),
    ("vsock", (), {EPERM}),
    ("unshare_user", (), {EPERM}),  # unshare -U: a user namespace, to regain a full capability set in it
    ("unshare_mount", (), {EPERM}),
    ("unshare_net", (), {EPERM}),
    ("clone_newpid", (), {EPERM}),
    ("setns", (), {EPERM}),
    ("reboot", (), {EPERM}),
    ("clock", (), {EPERM}),
    ("settimeofday", (), {EPERM}),
    ("bpf", (), {EPERM}),
    ("perf_event_open", (), {EPERM}),
    ("finit_module", (), {EPERM}),
    ("kexec_load", (), {EPERM}),
    ("keyctl", (), {EPERM}),
    ("add_key", (), {EPERM}),
    ("userfaultfd", (), {EPERM}),
    ("io_uring", (), {EPERM}),
    ("open_by_handle_at", (), {EPERM}),  # "shocker": open any host file by its handle
    ("iopl", (), {EPERM}),
    ("swapon", (), {EPERM}),
    ("syslog", (), {EPERM}),
]


def _arg(value: object, host: Host) -> object:
    if value == "@ksm":
        return host.ksm.strip()
    if isinstance(value, str) and value.startswith("@"):
        return host.sysctl(value[1:])
    return value


@pytest.mark.parametrize(
    ("name", "args", "errnos"), BLOCKED, ids=[f"{n}-{'-'.join(map(str, a))}" for n, a, _ in BLOCKED]
)
async def test_blocked(box: Box, host: Host, name: str, args: tuple[object, ...], errnos: set[str]) -> None:
    res = await box.attempt(name, *(_arg(a, host) for a in args))
    assert not res["escaped"], res
    assert res["errno"] in errnos, res
    assert (await box.ws.exec("echo alive")).stdout == "alive\n"  # the workspace itself is fine


@pytest.mark.parametrize("path", ["/proc/kmsg", "/proc/keys", "/proc/timer_list", "/proc/interrupts"])
async def test_masked_proc_files_read_empty(box: Box, host: Host, path: str) -> None:
    assert Path(path).exists()  # on the host
    res = await box.attempt("read_masked", path)
    assert not res["escaped"], res
    masked_dirs = await box.ws.exec("find /proc/acpi /sys/firmware -mindepth 1 | wc -l")
    assert masked_dirs.stdout.strip() == "0"


async def test_ptrace_of_a_host_process(box: Box, host: Host) -> None:
    res = await box.attempt("ptrace", host.sentinel.pid)
    assert not res["escaped"] and res["errno"] in {"ESRCH", EPERM}, res


async def test_file_capabilities_do_not_raise_privilege(box: Box, host: Host) -> None:
    res = await box.attempt("file_caps")
    assert not res["escaped"], res


async def test_chroot_break_out_reaches_only_the_workspace_root(box: Box, host: Host, tmp_path: Path) -> None:
    marker = tmp_path / "host-marker"
    marker.write_text("host")
    res = await box.attempt("chroot_escape", marker)
    assert not res["escaped"], res


async def test_kill_all_leaves_the_host_alive(box: Box, host: Host) -> None:
    with pytest.raises(BunshinError):
        r = await box.ws.exec("kill -9 -1; sleep 5", timeout=20)
        raise AssertionError(f"the agent survived kill -9 -1: {r}")
    if box.parent is not None:  # a copy's kill reaches nothing of its parent
        assert (await box.parent.exec("echo alive")).stdout == "alive\n"


async def test_fork_bomb_stops_at_the_pids_limit(where: str, host: Host) -> None:
    async with inside(where, Limits(pids=64)) as box:
        res = await box.attempt("fork_bomb", 64, timeout=60)
        assert not res["escaped"] and res["errno"] == "EAGAIN", res
        assert box.ws.cgroup is not None
        pids = next(d for d in box.ws.cgroup.dirs if d.parent.parent.name == "pids")
        assert int((pids / "pids.max").read_text()) == 64
        assert len(box.ws.cgroup.pids()) <= 64
        assert (await box.ws.exec("echo alive")).stdout == "alive\n"  # once the children are gone


async def test_disk_fill_stops_at_the_quota(where: str, host: Host) -> None:
    async with inside(where, Limits(disk=32 << 20)) as box:
        res = await box.attempt("fill_disk", 256, timeout=60)
        assert not res["escaped"] and res["errno"] == "ENOSPC", res
        assert int(res["detail"].split()[1]) <= 32
        # What it wrote is in its upper layer, on its own 32 MiB tmpfs, not on the host's disk.
        assert mount_options(box.ws.directory / "upper") is not None
        assert mount_options(box.ws.directory / "upper")[0] == "tmpfs"  # type: ignore[index]
        disk = os.statvfs(box.ws.directory / "upper")
        assert disk.f_blocks * disk.f_frsize <= 32 << 20 and disk.f_bavail * disk.f_frsize < 1 << 20
        assert (box.ws.directory / "upper/var/tmp/fill").stat().st_size > 16 << 20
        await box.ws.exec("rm /var/tmp/fill")
        assert (await box.ws.exec("echo ok > /workspace/after && cat /workspace/after")).stdout == "ok\n"


async def test_memory_fill_is_killed_inside_only(where: str, host: Host) -> None:
    async with inside(where, Limits(memory=128 << 20)) as box:
        r = await box.ws.exec(["python3", "/workspace/attempts.py", "fill_memory", "512"], timeout=60)
        assert r.exit_code in (137, -9), r  # SIGKILL from the workspace's own OOM killer
        assert box.ws._core.cgroup is not None and box.ws._core.cgroup.memory_dir is not None
        assert int((box.ws._core.cgroup.memory_dir / "memory.failcnt").read_text()) > 0
        assert (await box.ws.exec("echo alive")).stdout == "alive\n"
        if box.parent is not None:
            assert (await box.parent.exec("echo alive")).stdout == "alive\n"
