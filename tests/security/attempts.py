"""Escape attempts, run as root inside a workspace (python3 of the base image, no compiler): ``python3 attempts.py
NAME [ARG]...`` prints one JSON line, ``{"escaped": bool, "errno": "EPERM" | null, "detail": str}``. An attempt
that works would do its harm for real, so each picks the least harmful form that still proves the point (set the
clock to the time it already is, switch Ctrl-Alt-Del off, write the value a sysctl already has)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import struct
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

NR = {  # x86-64
    "iopl": 172, "reboot": 169, "init_module": 175, "finit_module": 313, "delete_module": 176, "add_key": 248,
    "keyctl": 250, "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "open_by_handle_at": 304, "name_to_handle_at": 303, "kexec_load": 246,
    "kexec_file_load": 320, "pivot_root": 155, "setns": 308, "unshare": 272, "clock_settime": 227,
    "settimeofday": 164, "acct": 163, "swapon": 167, "syslog": 103, "ptrace": 101, "mount": 165,
    "umount2": 166, "clone3": 435, "lookup_dcookie": 212, "quotactl": 179, "ioperm": 173,
}  # fmt: skip


def out(escaped: bool, err: int | None = None, detail: str = "") -> None:
    print(json.dumps({"escaped": escaped, "errno": errno.errorcode.get(err) if err else None, "detail": detail}))
    sys.exit(0)


def syscall(name: str, *args: int | bytes | ctypes.c_void_p | None) -> None:
    """Call it; report escaped if it returns >= 0."""
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(NR[name]), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    if ret >= 0:
        out(True, detail=f"{name} returned {ret}")
    out(False, ctypes.get_errno(), name)


def try_os(fn, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        res = fn(*args)
    except OSError as exc:
        out(False, exc.errno, f"{fn.__name__}: {exc}")
    out(True, detail=f"{fn.__name__} -> {res!r}")


def write(path: str, data: str) -> None:
    def _write() -> int:
        with open(path, "w") as f:
            return f.write(data)

    _write.__name__ = f"write {path}"
    try_os(_write)


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    os.makedirs(target, exist_ok=True)
    ctypes.set_errno(0)
    ret = libc.mount(
        source.encode(), target.encode(), fstype.encode() if fstype else None, ctypes.c_ulong(flags), data.encode()
    )
    if ret == 0:
        out(True, detail=f"mounted {fstype or source} on {target}")
    out(False, ctypes.get_errno(), f"mount {fstype or source}")


def mount_disk(major: int, minor: int) -> None:
    """A node for the host's disk, mounted read-only: the mount must fail (and under a user namespace, whose root
    has no CAP_MKNOD over the host's devices, the mknod already does)."""
    try:
        os.mknod("/tmp/hostdisk", 0o600 | 0o060000, os.makedev(major, minor))
    except OSError as exc:
        out(False, exc.errno, f"mknod: {exc}")
    mount("/tmp/hostdisk", "/tmp/disk", "ext4", 1)  # MS_RDONLY


def mknod_open(path: str, kind: str, major: int, minor: int) -> None:
    """Without a user namespace mknod is allowed (CAP_MKNOD, as in runc) and opening a node off the allow-list is
    what must fail; under one, mknod of a device fails (user_namespaces(7))."""
    mode = 0o600 | (0o020000 if kind == "c" else 0o060000)
    try:
        os.mknod(path, mode, os.makedev(major, minor))
    except OSError as exc:
        out(False, exc.errno, f"mknod: {exc}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        out(False, exc.errno, f"open: {exc}")
    try:
        data = os.read(fd, 64)
    except OSError as exc:
        out(True, detail=f"opened (read: {exc})")
    out(True, detail=f"opened and read {len(data)} bytes")


def socket_(family: int, kind: int, proto: int = 0) -> None:
    try:
        s = socket.socket(family, kind, proto)
    except OSError as exc:
        out(False, exc.errno, str(exc))
    s.close()
    out(True, detail="socket created")


def unshare(flag: int) -> None:
    syscall("unshare", flag)


def clone_ns(flag: int) -> None:
    """fork() through the raw clone syscall with a namespace flag (SIGCHLD | flag)."""
    ctypes.set_errno(0)
    pid = libc.syscall(ctypes.c_long(56), ctypes.c_long(17 | flag), *(ctypes.c_long(0),) * 4)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
        out(True, detail="clone with a namespace flag")
    out(False, ctypes.get_errno(), "clone")


def ptrace_outside(pid: int) -> None:
    syscall("ptrace", 16, pid, 0, 0)  # PTRACE_ATTACH


def read_masked(path: str) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except OSError as exc:
        out(False, exc.errno, str(exc))
    out(bool(data), detail=f"read {len(data)} bytes")


def clock() -> None:
    now = time.clock_gettime_ns(time.CLOCK_REALTIME)
    ts = struct.pack("qq", now // 10**9, now % 10**9)
    syscall("clock_settime", 0, ts)


def file_caps() -> None:
    """Give a copy of python3 file capabilities for everything (SETFCAP is kept, as in runc), exec it: the bounding
    set must still keep CAP_SYS_ADMIN out of the new process."""
    import shutil
    import subprocess

    shutil.copy("/usr/bin/python3.11", "/tmp/capython")
    # vfs_cap_data v2: magic_etc (VFS_CAP_REVISION_2 | EFFECTIVE), then permitted/inheritable per 32-bit word.
    os.setxattr("/tmp/capython", "security.capability", struct.pack("<IIIII", 0x02000001, 0xFFFFFFFF, 0, 0x1FF, 0))
    try:
        r = subprocess.run(["/tmp/capython", "-c", "print(open('/proc/self/status').read())"], capture_output=True)
    except OSError as exc:  # execve refuses a file whose effective capabilities the bounding set would cut
        out(False, exc.errno, f"exec: {exc}")
    eff = next(line for line in r.stdout.decode().splitlines() if line.startswith("CapEff"))
    has_admin = bool(int(eff.split()[1], 16) >> 21 & 1)
    out(has_admin, errno.EPERM if not has_admin else None, eff)


def chroot_escape(marker: str) -> None:
    """The classic chroot break-out (chroot into a subdir, keep a cwd outside, walk up): it only ever reaches the
    workspace's own root, which holds no host path."""
    os.makedirs("/tmp/jail", exist_ok=True)
    fd = os.open("/", os.O_RDONLY)
    os.chroot("/tmp/jail")
    os.fchdir(fd)
    for _ in range(64):
        os.chdir("..")
    os.chroot(".")
    out(os.path.exists(marker), errno.ENOENT, f"after break-out, / holds {sorted(os.listdir('/'))[:8]}")


def fork_bomb(limit: int) -> None:
    """Fork until the kernel says no; the children hold nothing the exec waits for."""
    made = 0
    for _ in range(limit * 4):
        try:
            pid = os.fork()
        except OSError as exc:
            out(False, exc.errno, f"forked {made}")
        if pid == 0:
            os.closerange(0, 256)
            time.sleep(3)
            os._exit(0)
        made += 1
    out(True, detail=f"forked {made} without a limit")


def fill_disk(mib: int) -> None:
    chunk = b"\0" * (1 << 20)
    written = 0
    try:
        with open("/var/tmp/fill", "wb") as f:
            for _ in range(mib):
                f.write(chunk)
                written += 1
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        out(False, exc.errno, f"wrote {written} MiB")
    out(True, detail=f"wrote {written} MiB")


def fill_memory(mib: int) -> None:
    blocks = []
    for _ in range(mib):
        blocks.append(bytearray(1 << 20))
    out(True, detail=f"allocated {mib} MiB")


def main() -> None:
    name, *args = sys.argv[1:]
    CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x20000, 0x10000000, 0x40000000, 0x20000000
    attempts = {
        "core_pattern": lambda: write("/proc/sys/kernel/core_pattern", "|/bin/sh -c 'touch /pwned'"),
        "drop_caches": lambda: write("/proc/sys/vm/drop_caches", "1"),
        "sysctl": lambda: write(f"/proc/sys/{args[0]}", args[1]),
        "sys_write": lambda: write(f"/sys/{args[0]}", args[1]),
        "sysrq": lambda: write("/proc/sysrq-trigger", "h"),
        "remount_proc_sys": lambda: mount("none", "/proc/sys", "", 0x20 | 0x1000),  # MS_REMOUNT | MS_BIND, rw
        "mount_proc": lambda: mount("proc", "/tmp/p", "proc"),
        "mount_sysfs": lambda: mount("sysfs", "/tmp/s", "sysfs"),
        "mount_tmpfs_root": lambda: mount("tmpfs", "/", "tmpfs"),
        "mount_cgroup": lambda: mount("cgroup", "/tmp/cg", "cgroup", 0, "memory"),
        "mount_cgroup2": lambda: mount("cgroup2", "/tmp/cg2", "cgroup2"),
        "mount_disk": lambda: mount_disk(int(args[0]), int(args[1])),
        "mknod": lambda: mknod_open(args[0], args[1], int(args[2]), int(args[3])),
        "af_packet": lambda: socket_(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)),
        "raw_socket": lambda: socket_(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
        "vsock": lambda: socket_(40, socket.SOCK_STREAM),
        "unshare_user": lambda: unshare(CLONE_NEWUSER),
        "unshare_mount": lambda: unshare(CLONE_NEWNS),
        "unshare_net": lambda: unshare(CLONE_NEWNET),
        "clone_newpid": lambda: clone_ns(CLONE_NEWPID),
        "setns": lambda: syscall("setns", os.open("/proc/self/ns/net", os.O_RDONLY), 0),
        "ptrace": lambda: ptrace_outside(int(args[0])),
        "reboot": lambda: syscall("reboot", 0xFEE1DEAD, 672274793, 0, None),  # LINUX_REBOOT_CMD_CAD_OFF
        "clock": clock,
        "settimeofday": lambda: syscall("settimeofday", None, struct.pack("ii", 0, 0)),
        "bpf": lambda: syscall("bpf", 0, struct.pack("IIII", 2, 4, 4, 1), 16),  # BPF_MAP_CREATE, an array map
        "perf_event_open": lambda: syscall("perf_event_open", struct.pack("IIQ", 1, 112, 0) + bytes(96), 0, -1, -1, 0),
        "finit_module": lambda: syscall("finit_module", os.open("/bin/sh", os.O_RDONLY), b"", 0),
        "kexec_load": lambda: syscall("kexec_load", 0, 0, None, 0),
        "keyctl": lambda: syscall("keyctl", 0, -3, 1),  # KEYCTL_GET_KEYRING_ID of the session keyring, create
        "add_key": lambda: syscall("add_key", b"user", b"x", b"y", 1, -3),
        "userfaultfd": lambda: syscall("userfaultfd", 0),
        "io_uring": lambda: syscall("io_uring_setup", 1, bytes(120)),
        "open_by_handle_at": lambda: syscall("open_by_handle_at", -100, struct.pack("II", 8, 1) + bytes(8), 0),
        "iopl": lambda: syscall("iopl", 3),
        "swapon": lambda: syscall("swapon", b"/tmp/swap", 0),
        "syslog": lambda: syscall("syslog", 3, ctypes.create_string_buffer(256), 256),  # SYSLOG_ACTION_READ_ALL
        "read_masked": lambda: read_masked(args[0]),
        "file_caps": file_caps,
        "chroot_escape": lambda: chroot_escape(args[0]),
        "fork_bomb": lambda: fork_bomb(int(args[0])),
        "fill_disk": lambda: fill_disk(int(args[0])),
        "fill_memory": lambda: fill_memory(int(args[0])),
    }
    attempts[name]()


if __name__ == "__main__":
    main()
