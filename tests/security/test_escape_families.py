"""The container families of the published sandbox-escape benchmarks, run as hostile root code in a workspace and in
a live fork of one (``box``): privileged settings, a runtime socket reachable, writable /proc, excess capabilities,
kernel module loading, a shared host pid namespace, cgroup release_agent, /proc/self/exe overwrite of a runtime
binary, a leaked host file descriptor or working directory. Each asserts the specific failure inside and, on the host
side, that what the attempt aimed at is unchanged (``host``: sysctls, mounts, clock, a host process; here also the
host's runtime binaries, its cgroup release agents, the listeners it holds)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import bunshin_async
from bunshin_async import BunshinError
from bunshin_async._host import _paths
from bunshin_async._host._kernel import CGROUP_ROOT
from bunshin_async._host._security import CAPABILITIES, DEFAULT_CAPABILITIES

from .conftest import Box, Host

pytestmark = pytest.mark.usefixtures("host")

DEFAULT_SET = f"{sum(1 << CAPABILITIES.index(c) for c in DEFAULT_CAPABILITIES):016x}"
ALLOWED_NODES = {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2)}  # null zero full random urandom tty ptmx
RUNTIME_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock",
                   "/run/containerd/containerd.sock.ttrpc", "/run/crio/crio.sock", "/run/podman/podman.sock",
                   "/run/user/0/podman/podman.sock", "/var/run/bunshin/mcp.sock", "@/containerd-shim/k8s.io.sock",
                   "@/run/containerd/s/0")  # fmt: skip


async def test_privileged_settings_are_off(box: Box) -> None:
    """What ``--privileged`` turns on: every capability, no seccomp, no_new_privs unset, the host's devices. Every
    process the workspace shows holds the default set and the filter, and its tree holds only allowed nodes."""
    await box.ws.spawn(["sleep", "600"])
    seen = (await box.attempt("statuses"))["statuses"]
    assert len(seen) >= 4, seen  # init, agent, the sleeper, the probe
    for pid, st in seen.items():
        assert st["CapPrm"] == st["CapEff"] == st["CapBnd"] == DEFAULT_SET, (pid, st)
        assert st["CapInh"] == st["CapAmb"] == "0" * 16, (pid, st)
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", (pid, st)
    nodes = (await box.attempt("device_nodes"))["nodes"]
    assert "/dev/null" in nodes and "/dev/pts/ptmx" in nodes, nodes
    foreign = {p: n for p, n in nodes.items() if n[0] != "c" or (n[1], n[2]) not in ALLOWED_NODES and n[1] != 136}
    assert not foreign, f"host device nodes in the workspace: {foreign}"
    res = await box.attempt("remount_sys_rw")
    assert not res["escaped"] and res["errno"] == "EPERM", res


@pytest.fixture
def host_listeners() -> Iterator[list[socket.socket]]:
    """A Unix socket listening on the host at a path, one under an abstract name, and a TCP one on every address:
    no workspace may reach them (connections queue in the backlog without an accept, so a reached one is seen)."""
    name = f"bunshin-sec-{uuid.uuid4().hex}"
    path = Path(f"/run/{name}.sock")
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    socks.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    socks[0].bind(str(path))
    socks[1].bind("\0" + name)
    socks[2].bind(("0.0.0.0", 0))
    for s in socks:
        s.listen(16)
        s.setblocking(False)
    try:
        yield socks
        for s in socks:
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in socks:
            s.close()
        path.unlink()


def _host_listening_unix_sockets() -> list[str]:
    """The names of every listening Unix socket of the host's network namespace (paths and ``@``abstract names),
    as /proc/net/unix lists them (flags 00010000: __SO_ACCEPTCON)."""
    names = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split(None, 7)
        if len(fields) == 8 and fields[3] == "00010000" and "\n" not in fields[7]:
            names.append(fields[7])
    return names


def _host_tcp_targets(extra_port: int) -> list[str]:
    """Every listening TCP port of the host's network namespace (Docker's 2375/2376 where it listens, Redis, Ray,
    the MCP server...), at loopback and at the host's outward address, as ``tcp:ADDRESS:PORT``."""
    ports = {extra_port}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # TCP_LISTEN
            ports.add(int(local.split(":")[1], 16))
    addresses = ["127.0.0.1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe, contextlib.suppress(OSError):
        probe.connect(("192.0.2.1", 9))  # no packet: only picks the address of the route out
        addresses.append(probe.getsockname()[0])
    return [f"tcp:{a}:{p}" for a in addresses for p in sorted(ports)]


async def test_no_runtime_or_host_socket_is_reachable(box: Box, host_listeners: list[socket.socket]) -> None:
    """Docker's, containerd's, podman's and Bunshin's sockets, every listener of the host (Unix sockets by path and
    abstract name, TCP ports at loopback and the host's address), and three made for the test: none connects; the
    workspace's tree and network namespace hold its agent's socket only."""
    own = [host_listeners[0].getsockname(), "@" + host_listeners[1].getsockname()[1:].decode()]
    targets = sorted({*RUNTIME_SOCKETS, *_host_listening_unix_sockets(), *own})
    targets += _host_tcp_targets(host_listeners[2].getsockname()[1])
    assert len(targets) > len(RUNTIME_SOCKETS)
    await box.ws.write_file("/workspace/targets", "\n".join(targets) + "\n")
    res = await box.attempt("sockets", "/workspace/targets")
    assert res["reached"] == [], res
    assert set(res["refused"]) <= {"ENOENT", "ECONNREFUSED", "ENETUNREACH"}, res
    assert sum(res["refused"].values()) == len(targets), res
    assert res["listed"] == res["in_tree"] == ["/run/bunshin/agent.sock"], res


async def test_proc_is_not_writable(box: Box) -> None:
    """Every file under /proc/sys, the sysrq trigger, the module helper, binfmt_misc's register, the uevent helper:
    none opens for writing (absent files on a kernel built without them count as absent); /proc/sys and a mask
    cannot be unmounted to uncover what is below."""
    res = await box.attempt("proc_sys_writable")
    assert res["writable"] == [] and sum(res["refused"].values()) > 100, res
    assert set(res["refused"]) <= {"EROFS", "EACCES"}, res
    for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/modprobe", "/proc/sys/fs/binfmt_misc/register",
                 "/sys/kernel/uevent_helper", "/sys/kernel/mm/ksm/run"):  # fmt: skip
        res = await box.attempt("open_for_write", path)
        assert not res["escaped"], res
        # read-only mounts refuse what exists on this kernel; a masked file reads as absent (a bind of /dev/null)
        assert res["errno"] in ({"EROFS", "ENOENT"} if Path(path).exists() else {"ENOENT"}), res
    for name, args in (("umount", ("/proc/sys",)), ("umount", ("/proc/kcore",)), ("mount_binfmt_misc", ())):
        res = await box.attempt(name, *args)
        assert not res["escaped"] and res["errno"] == "EPERM", res


async def test_no_capability_beyond_the_default_set(box: Box) -> None:
    """capset to every capability, CAP_SYS_ADMIN raised into the ambient set, and three capabilities moby's default
    leaves out used for real (NET_ADMIN, SYS_RESOURCE, SYS_NICE): each refused."""
    tried = (await box.attempt("capabilities"))["tried"]
    assert tried == {"capset": "EPERM", "ambient": "EPERM", "net_admin": "EPERM", "sys_resource": "EPERM",
                     "sys_nice": "EACCES"}, tried  # fmt: skip


@pytest.mark.parametrize("name", ["init_module", "delete_module"])
async def test_kernel_modules_cannot_be_loaded_or_removed(box: Box, name: str) -> None:
    res = await box.attempt(name)
    assert not res["escaped"] and res["errno"] == "EPERM", res


def _inner_pids(box: Box) -> dict[str, str]:
    """The workspace's processes as the host sees them: pid in the workspace's namespace (NSpid's last) -> comm."""
    assert box.ws.cgroup is not None
    out = {}
    for pid in box.ws.cgroup.pids():
        with_status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        out[with_status["NSpid"].split()[-1]] = with_status["Name"].strip()
    return out


async def test_the_pid_namespace_is_the_workspaces_own(box: Box, host: Host) -> None:
    """Only the workspace's processes are visible (checked against the host's view of its cgroup), a host process
    can be neither signalled nor held by a pidfd, and none of its namespaces but the cgroup one is the host's."""
    await box.ws.spawn(["sleep", "600"])
    res = await box.attempt("pid_view", host.sentinel.pid)
    inside = {pid: comm for pid, comm in res["pids"].items() if int(pid) != res["me"]}
    host_view = _inner_pids(box)
    assert inside.items() <= host_view.items(), (inside, host_view)
    assert inside["1"] == "bunshin-init" and "sleep" in inside.values(), inside
    assert str(host.sentinel.pid) not in res["pids"] and res["kill"] == "ESRCH" and res["pidfd"] == "ESRCH", res
    for ns, link in res["ns"].items():
        if ns != "cgroup":  # cgroup v1 has no namespaced hierarchy that CRIU restores: the host's, as Docker on v1
            assert link != os.readlink(f"/proc/self/ns/{ns}"), (ns, link)


def _cgroup_controls(box: Box) -> dict[str, str]:
    """The host's release agents (every v1 hierarchy's root) and the notify_on_release of the workspace's cgroups."""
    assert box.ws.cgroup is not None
    files = [*CGROUP_ROOT.glob("*/release_agent"), *CGROUP_ROOT.glob("*/notify_on_release")]
    files += [d / "notify_on_release" for d in box.ws.cgroup.dirs if (d / "notify_on_release").exists()]
    assert files
    return {str(f): f.read_text() for f in files}


async def test_cgroup_release_agent_is_out_of_reach(box: Box) -> None:
    """CVE-2022-0492's sequence (a user, mount and cgroup namespace, a v1 hierarchy mounted, release_agent written)
    fails at its first step; no cgroup control file is reachable inside; the host's are unchanged."""
    before = _cgroup_controls(box)
    res = await box.attempt("cgroup_control")
    assert res["steps"] == {"unshare -UmC": "EPERM", "unshare -C": "EPERM", "mount cgroup rdma": "EPERM"}, res
    assert res["cgroup_mounts"] == [] and res["opened"] == [], res
    res = await box.attempt("unshare_cgroup")
    assert not res["escaped"] and res["errno"] == "EPERM", res
    assert _cgroup_controls(box) == before


def _runtime_binaries() -> dict[str, tuple[int, int, int, str]]:
    """The host's files a /proc/<pid>/exe write could aim at: the agent and init built into the package, the
    agent layers (and their shifted copies) they run from, CRIU (it restores a copy's processes) and the Python
    running the SDK. Inode, size, mtime and content of each."""
    pkg = Path(bunshin_async.__file__).parent
    paths = [pkg / "bunshin-init", pkg / "bunshin-agent", Path(os.path.realpath(sys.executable))]
    paths += sorted(Path("/var/lib/bunshin/agent").glob("*/root*/opt/bunshin/bunshin-*"))
    if (criu := _paths.criu_binary()) is not None:
        paths.append(criu)
    out = {}
    for p in paths:
        st = p.stat()
        out[str(p)] = (st.st_ino, st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


async def test_proc_exe_of_a_runtime_binary_cannot_be_overwritten(box: Box) -> None:
    """CVE-2019-5736: /proc/<pid>/exe of init, the agent and every other process opened for writing, directly and
    through a re-opened O_PATH descriptor; also after the image's /bin/sh became ``#!/proc/self/exe`` and the host
    ran a command (the runtime then executes the workspace's own agent, not a host binary). Every open fails with
    ETXTBSY and the host's binaries are unchanged."""
    before = _runtime_binaries()
    await box.ws.spawn(["sleep", "600"])
    res = await box.attempt("exe_overwrite")
    targets = {r["target"] for r in res["tried"].values()}
    assert {"/opt/bunshin/bunshin-init", "/opt/bunshin/bunshin-agent", "/usr/bin/sleep"} <= targets, res
    for pid, r in res["tried"].items():
        assert r["direct"] == r["o_path"] == "ETXTBSY", (pid, r)
    await box.ws.write_file("/workspace/evil-sh", "#!/proc/self/exe\n")
    r = await box.ws.exec("cp /bin/sh /bin/sh.real && chmod +x /workspace/evil-sh && cp /workspace/evil-sh /bin/sh")
    assert r.exit_code == 0, r
    with contextlib.suppress(BunshinError):  # whatever /bin/sh now does, it does inside
        await box.ws.exec("echo triggered", timeout=20)
    res = await box.attempt("exe_overwrite")
    assert all(r["direct"] == r["o_path"] == "ETXTBSY" for r in res["tried"].values()), res
    assert (await box.ws.exec(["/bin/sh.real", "-c", "cp /bin/sh.real /bin/sh && echo ok"])).stdout == "ok\n"
    assert _runtime_binaries() == before


libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _mnt_id(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("mnt_id:"):
            return int(line.split()[1])
    raise AssertionError("no mnt_id")


def _internal_mounts() -> set[int]:
    """The kernel's internal mounts a descriptor without a path sits on (pipefs, sockfs, pidfs, anon inodes), read
    from descriptors of those kinds made here."""
    r, w = os.pipe()
    s = socket.socket()
    pidfd = os.pidfd_open(os.getpid())
    efd = os.eventfd(0)
    try:
        return {_mnt_id(fd) for fd in (r, s.fileno(), pidfd, efd)}
    finally:
        for fd in (r, w, pidfd, efd):
            os.close(fd)
        s.close()


def _foreign_fds(box: Box) -> tuple[int, list[str]]:
    """Every descriptor of every process of the workspace, taken with pidfd_getfd and looked at here (never by a
    path): each must sit on a mount of that process's mount namespace or be a pipe, socket, pidfd or anon inode."""
    assert box.ws.cgroup is not None
    internal = _internal_mounts()
    foreign, checked = [], 0
    for pid in box.ws.cgroup.pids():
        mounts = {int(line.split()[0]) for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}
        pidfd = os.pidfd_open(pid)
        try:
            for name in os.listdir(f"/proc/{pid}/fd"):
                ctypes.set_errno(0)
                fd = int(libc.syscall(438, pidfd, int(name), 0))  # pidfd_getfd
                if fd < 0:
                    continue  # closed meanwhile
                try:
                    checked += 1
                    if (mnt := _mnt_id(fd)) not in mounts and mnt not in internal:
                        foreign.append(f"pid {pid} fd {name} on mount {mnt}")
                finally:
                    os.close(fd)
        finally:
            os.close(pidfd)
    return checked, foreign


async def test_no_host_descriptor_or_directory_leaks_in(box: Box, tmp_path: Path) -> None:
    """CVE-2024-21626: no process of the workspace (init, agent, a spawned and an exec'd one) holds a descriptor on
    a mount outside its mount namespace (checked on the host with pidfd_getfd); inside, every working directory,
    root and directory descriptor walks up (``..``) to the workspace's root, never to a host file."""
    marker = tmp_path / f"host-{uuid.uuid4().hex}"
    marker.write_text("host")
    await box.ws.spawn(["sleep", "600"])
    checked, foreign = _foreign_fds(box)
    assert checked >= 9 and not foreign, foreign  # 3 stdio each for init, agent, sleeper, and the agent's socket
    res = await box.attempt("leaked_dirs", marker)
    assert res["escaped"] == [] and res["foreign_mounts"] == [] and res["checked"] >= 6, res
