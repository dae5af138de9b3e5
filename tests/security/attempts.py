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
    """Fork until the kernel says no; the children hold nothing the exec waits for, and their pids until the exec's
    end kills them (however slowly this machine forks)."""
    made = 0
    for _ in range(limit * 4):
        try:
            pid = os.fork()
        except OSError as exc:
            out(False, exc.errno, f"forked {made}")
        if pid == 0:
            os.closerange(0, 256)
            time.sleep(3600)
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


# ------------------------------------------------------------------------------------------------ container families
# The families of the published container-escape benchmarks: each gathers what it saw into one JSON line; the test
# decides, on the host side too, whether anything was reached.


def report(**fields: object) -> None:
    print(json.dumps(fields))
    sys.exit(0)


def errno_of(fn, *args) -> str | None:  # type: ignore[no-untyped-def]
    """None if ``fn`` worked, else the errno's name."""
    try:
        fn(*args)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return None


def open_for_write(path: str) -> None:
    """Open a control file for writing and write nothing: opening is what must fail. A file masked by a bind of
    /dev/null opens (as in runc) and reaches nothing, which is not an escape."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError as exc:
        out(False, exc.errno, f"open {path}: {exc}")
    st = os.fstat(fd)
    os.close(fd)
    if st.st_rdev == os.makedev(1, 3) and (st.st_mode & 0o170000) == 0o020000:
        out(False, errno.ENOENT, f"{path} is masked by /dev/null")
    out(True, detail=f"opened {path} for writing")


def writable_files(tops: list[str], only: tuple[str, ...] = ()) -> tuple[list[str], dict[str, int]]:
    """Every file below ``tops`` (those named in ``only``, if given) opened for writing, nothing written: the ones
    that opened, and how many were refused with each errno."""
    opened, refused = [], {}
    for top_dir in tops:
        for top, _dirs, files in os.walk(top_dir):
            for name in files:
                if only and name not in only:
                    continue
                path = os.path.join(top, name)
                err = errno_of(lambda p: os.close(os.open(p, os.O_WRONLY | os.O_NOFOLLOW)), path)
                if err is None:
                    opened.append(path)
                else:
                    refused[err] = refused.get(err, 0) + 1
    return opened, refused


def proc_sys_writable() -> None:
    """Every file under /proc/sys opened for writing (and nothing written)."""
    writable, refused = writable_files(["/proc/sys"])
    report(writable=writable, refused=refused)


def statuses() -> None:
    """The security fields of every process this pid namespace shows."""
    fields = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                lines = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        except OSError:
            continue  # gone
        found[pid] = {k: lines[k].strip() for k in fields}
    report(statuses=found)


def device_nodes() -> None:
    """Every device node in the workspace's tree (its root mount; /proc and /sys are not device holders)."""
    nodes = {}
    root_dev = os.lstat("/").st_dev
    for top, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if os.lstat(os.path.join(top, d)).st_dev == root_dev or top == "/dev"]
        for name in dirs + files:
            path = os.path.join(top, name)
            st = os.lstat(path)
            kind = st.st_mode & 0o170000
            if kind in (0o020000, 0o060000):
                nodes[path] = ["c" if kind == 0o020000 else "b", os.major(st.st_rdev), os.minor(st.st_rdev)]
    report(nodes=nodes)


def capabilities() -> None:
    """Raise every capability in the permitted and effective sets (capset), raise CAP_SYS_ADMIN into the ambient
    set, use NET_ADMIN (the MTU lo already has), SYS_RESOURCE (a hard RLIMIT_NOFILE above the current one) and
    SYS_NICE (the niceness -20)."""
    import fcntl
    import resource

    tried = {}
    hdr = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = struct.pack("IIIIII", *(0xFFFFFFFF,) * 6)
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(126), hdr, data)  # capset
    tried["capset"] = None if ret == 0 else errno.errorcode[ctypes.get_errno()]
    ctypes.set_errno(0)
    ret = libc.prctl(47, 2, 21, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_SYS_ADMIN
    tried["ambient"] = None if ret == 0 else errno.errorcode[ctypes.get_errno()]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ifr = struct.pack("16si", b"lo", 0)
    mtu = struct.unpack("16si", fcntl.ioctl(s, 0x8921, ifr))[1]  # SIOCGIFMTU
    tried["net_admin"] = errno_of(fcntl.ioctl, s, 0x8922, struct.pack("16si", b"lo", mtu))  # SIOCSIFMTU
    s.close()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ctypes.set_errno(0)
    ret = libc.prlimit(0, resource.RLIMIT_NOFILE, struct.pack("QQ", soft, hard + 1), None)
    tried["sys_resource"] = None if ret == 0 else errno.errorcode[ctypes.get_errno()]
    tried["sys_nice"] = errno_of(os.setpriority, os.PRIO_PROCESS, 0, -20)
    report(tried=tried)


def sockets(targets_file: str) -> None:
    """Connect to each socket named in ``targets_file`` (one per line: a Unix socket's path, ``@`` and an abstract
    name, or ``tcp:ADDRESS:PORT``), and list every Unix socket this workspace's tree and network namespace show."""
    with open(targets_file) as f:
        targets = [t for t in f.read().split("\n") if t]
    reached, refused = [], {}
    for t in targets:
        if t.startswith("tcp:"):
            host, port = t[4:].rsplit(":", 1)
            s, addr = socket.socket(socket.AF_INET, socket.SOCK_STREAM), (host, int(port))
        else:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            addr = "\0" + t[1:] if t.startswith("@") else t
        s.settimeout(2)
        try:
            s.connect(addr)
            reached.append(t)
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, str(exc))
            refused[name] = refused.get(name, 0) + 1
        finally:
            s.close()
    with open("/proc/net/unix") as f:
        listed = sorted({line.split()[7] for line in f.read().splitlines()[1:] if len(line.split()) > 7})
    in_tree = []
    root_dev = os.lstat("/").st_dev
    for top, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if os.lstat(os.path.join(top, d)).st_dev == root_dev]
        for name in files:
            path = os.path.join(top, name)
            if os.lstat(path).st_mode & 0o170000 == 0o140000:
                in_tree.append(path)
    report(reached=reached, refused=refused, listed=listed, in_tree=sorted(in_tree))


def pid_view(sentinel: int) -> None:
    """What the pid namespace shows: every pid with its command name, the namespaces of this process, and whether a
    host process (``sentinel``, by its host pid) can be signalled or held by a pidfd."""
    pids = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                pids[pid] = f.read().strip()
        except OSError:
            continue
    ns = {n: os.readlink(f"/proc/self/ns/{n}") for n in ("pid", "mnt", "net", "ipc", "uts", "user", "cgroup")}
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(434), ctypes.c_long(sentinel), ctypes.c_long(0))  # pidfd_open
    pidfd = "opened" if ret >= 0 else errno.errorcode[ctypes.get_errno()]
    report(pids=pids, me=os.getpid(), parent=os.getppid(), ns=ns, kill=errno_of(os.kill, sentinel, 0), pidfd=pidfd)


def cgroup_control() -> None:
    """The release_agent escape (CVE-2022-0492): a user, mount and cgroup namespace of one's own, a cgroup v1
    hierarchy mounted in it, release_agent written. Then every cgroup control file already reachable (any cgroup
    mount this workspace shows) opened for writing, nothing written."""
    steps = {}
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(NR["unshare"]), ctypes.c_long(0x10000000 | 0x20000 | 0x02000000))
    steps["unshare -UmC"] = None if ret == 0 else errno.errorcode[ctypes.get_errno()]
    steps["unshare -C"] = None
    ctypes.set_errno(0)
    if libc.syscall(ctypes.c_long(NR["unshare"]), ctypes.c_long(0x02000000)) != 0:
        steps["unshare -C"] = errno.errorcode[ctypes.get_errno()]
    os.makedirs("/tmp/cgrp", exist_ok=True)
    ctypes.set_errno(0)
    ret = libc.mount(b"cgroup", b"/tmp/cgrp", b"cgroup", ctypes.c_ulong(0), b"rdma")
    steps["mount cgroup rdma"] = None if ret == 0 else errno.errorcode[ctypes.get_errno()]
    control = ("release_agent", "notify_on_release", "cgroup.procs", "tasks", "devices.allow", "cgroup.subtree_control")
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f if " - cgroup" in line]
    opened, refused = writable_files([*points, "/sys/fs/cgroup"], control)
    report(steps=steps, cgroup_mounts=points, opened=opened, refused=refused)


def exe_overwrite() -> None:
    """CVE-2019-5736: open every process's /proc/<pid>/exe for writing, directly and by re-opening an O_PATH
    descriptor of it through /proc/self/fd (what runc's exploit did); nothing is written, and what opened is
    reported with the file it reached (device and inode, as the workspace sees them)."""
    tried = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        exe = f"/proc/{pid}/exe"
        try:
            target = os.readlink(exe)
        except OSError:
            continue
        res = {"target": target}
        try:
            fd = os.open(exe, os.O_WRONLY)
            st = os.fstat(fd)
            os.close(fd)
            res["direct"] = f"opened {st.st_dev}:{st.st_ino}"
        except OSError as exc:
            res["direct"] = errno.errorcode.get(exc.errno or 0, str(exc))
        try:
            path_fd = os.open(exe, os.O_PATH)
        except OSError as exc:
            res["o_path"] = errno.errorcode.get(exc.errno or 0, str(exc))
        else:
            try:
                fd = os.open(f"/proc/self/fd/{path_fd}", os.O_WRONLY)
                st = os.fstat(fd)
                os.close(fd)
                res["o_path"] = f"opened {st.st_dev}:{st.st_ino}"
            except OSError as exc:
                res["o_path"] = errno.errorcode.get(exc.errno or 0, str(exc))
            os.close(path_fd)
        tried[pid] = res
    report(tried=tried)


def _top(fd: int) -> tuple[int, int]:
    """The device and inode of the topmost directory reached by walking ``..`` from a directory descriptor."""
    cur = os.dup(fd)
    try:
        for _ in range(4096):
            up = os.open("..", os.O_PATH | os.O_DIRECTORY, dir_fd=cur)
            a, b = os.fstat(cur), os.fstat(up)
            os.close(cur)
            cur = up
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                return a.st_dev, a.st_ino
        raise RuntimeError("no top")
    finally:
        os.close(cur)


def leaked_dirs(marker: str) -> None:
    """CVE-2024-21626: the working directory, root and every directory descriptor of every process, walked up by
    ``..`` from its descriptor: each must end at this workspace's root, and none may reach ``marker`` (a host file);
    and every descriptor must sit on a mount of this mount namespace (its fdinfo's mnt_id)."""
    root = os.stat("/")
    with open("/proc/self/mountinfo") as f:
        mounts = {int(line.split()[0]) for line in f}
    escaped, checked = [], 0
    foreign_mounts: list[str] = []
    internal: set[int] = set()
    r, w = os.pipe()
    s = socket.socket()
    pidfd = os.pidfd_open(os.getpid())
    for fd in (r, s.fileno(), pidfd):
        with open(f"/proc/self/fdinfo/{fd}") as f:
            internal.add(int(next(line for line in f if line.startswith("mnt_id:")).split()[1]))
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            names = [("cwd", f"/proc/{pid}/cwd"), ("root", f"/proc/{pid}/root")]
            names += [(f"fd {n}", f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for what, path in names:
            try:
                fd = os.open(path, os.O_PATH)
            except OSError:
                continue  # gone, or a socket or pipe (no path to open)
            try:
                with open(f"/proc/self/fdinfo/{fd}") as f:
                    mnt = int(next(line for line in f if line.startswith("mnt_id:")).split()[1])
                if mnt not in mounts and mnt not in internal:
                    foreign_mounts.append(f"{pid} {what} mnt_id {mnt}")
                st = os.fstat(fd)
                if st.st_mode & 0o170000 == 0o040000:
                    checked += 1
                    top = _top(fd)
                    reach = os.path.join(f"/proc/self/fd/{fd}", "../" * 64, marker.lstrip("/"))
                    if top != (root.st_dev, root.st_ino) or os.path.lexists(reach):
                        escaped.append(f"{pid} {what}")
            finally:
                os.close(fd)
    for fd in (r, w, pidfd):
        os.close(fd)
    s.close()
    report(escaped=escaped, foreign_mounts=foreign_mounts, checked=checked)


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
        "init_module": lambda: syscall("init_module", ctypes.create_string_buffer(64), 64, b""),
        "delete_module": lambda: syscall("delete_module", b"ext4", 0o4000),  # O_NONBLOCK
        "unshare_cgroup": lambda: unshare(0x02000000),
        "mount_binfmt_misc": lambda: mount("binfmt_misc", "/tmp/binfmt", "binfmt_misc"),
        "remount_sys_rw": lambda: mount("none", "/sys", "", 0x20),  # MS_REMOUNT, without MS_RDONLY
        "umount": lambda: syscall("umount2", args[0].encode(), 2),  # MNT_DETACH: unmask what is under it
        "open_for_write": lambda: open_for_write(args[0]),
        "proc_sys_writable": proc_sys_writable,
        "statuses": statuses,
        "device_nodes": device_nodes,
        "capabilities": capabilities,
        "sockets": lambda: sockets(args[0]),
        "pid_view": lambda: pid_view(int(args[0])),
        "cgroup_control": cgroup_control,
        "exe_overwrite": exe_overwrite,
        "leaked_dirs": lambda: leaked_dirs(args[0]),
    }
    attempts[name]()


if __name__ == "__main__":
    main()
