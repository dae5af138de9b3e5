"""The boundary's configuration: what every process of a workspace holds (seen from the host), that forks and
rollbacks keep exactly that, and that each relaxation of ``Security`` is explicit, named, logged and takes effect."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import anyio
import pytest

from bunshin_async import Limits, Security, SecurityError, Workspace
from bunshin_async._cli._doctor import security_checks
from bunshin_async._host._security import CAPABILITIES, DEFAULT_CAPABILITIES, DEFAULT_DEVICES

FORBIDDEN = ("SYS_ADMIN", "SYS_MODULE", "SYS_RAWIO", "SYS_PTRACE", "SYS_TIME", "SYS_BOOT", "MAC_ADMIN", "NET_ADMIN",
             "BPF", "PERFMON", "SYSLOG", "NET_RAW", "DAC_READ_SEARCH", "SYS_RESOURCE")  # fmt: skip
FIELDS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "Seccomp_filters")


def _status(pid: int) -> dict[str, str]:
    """The security fields of a process, read on the host."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = value.strip()
    return out


def _tree(ws: Workspace) -> dict[str, dict[str, str]]:
    """Every process of the workspace (host view), by its command name: pid 1, the agent, a spawned sleeper."""
    assert ws.cgroup is not None
    out = {}
    for pid in ws.cgroup.pids():
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        out[name] = _status(pid)
    return out


async def test_every_process_holds_the_default_set_and_forks_keep_it() -> None:
    want = sum(1 << CAPABILITIES.index(c) for c in DEFAULT_CAPABILITIES)
    async with Workspace() as ws:
        await ws.spawn(["sleep", "600"])
        with anyio.fail_after(10):
            while "sleep" not in (tree := _tree(ws)):
                await anyio.sleep(0.01)
        assert "bunshin-init" in tree
        for name, st in tree.items():
            for field in ("CapPrm", "CapEff", "CapBnd"):
                assert int(st[field], 16) == want, (name, field, st)
            assert int(st["CapInh"], 16) == 0 and int(st["CapAmb"], 16) == 0, (name, st)
            assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", (name, st)
            eff = int(st["CapEff"], 16)
            assert not any(eff >> CAPABILITIES.index(c) & 1 for c in FORBIDDEN), (name, st)
        copies = await ws.fork(2)
        try:
            for copy in copies:
                assert copy.fork_mode.startswith("criu")
                assert _tree(copy) == tree  # the same capability sets, no_new_privs and seccomp filters
                assert copy.security == ws.security
            async with await copies[0].snapshot() as snap:  # a fork of a fork, then a rollback
                (grandchild,) = await Workspace.from_snapshot(snap)
                try:
                    assert _tree(grandchild) == tree
                finally:
                    await grandchild.aclose()
                await ws.rollback(snap)
                assert _tree(ws) == tree
        finally:
            for copy in copies:
                await copy.aclose()


async def test_device_allow_list_and_limits_in_the_cgroup() -> None:
    async with Workspace(limits=Limits(nofile=512)) as ws:
        assert ws.cgroup is not None
        devices = next(d for d in ws.cgroup.dirs if d.parent.parent.name == "devices")
        listed = set((devices / "devices.list").read_text().split("\n")) - {""}
        assert listed == set(DEFAULT_DEVICES)
        assert (await ws.exec("ulimit -Sn; ulimit -Hn")).stdout.split() == ["512", "512"]
        (copy,) = await ws.fork()
        try:
            assert copy.cgroup is not None
            copy_devices = next(d for d in copy.cgroup.dirs if d.parent.parent.name == "devices")
            assert set((copy_devices / "devices.list").read_text().split("\n")) - {""} == listed
            assert (await copy.exec("ulimit -Hn")).stdout.strip() == "512"
            assert (await copy.exec("head -c 4 /dev/urandom | wc -c")).stdout.strip() == "4"
        finally:
            await copy.aclose()


async def test_relaxations_are_named_logged_and_take_effect(caplog: pytest.LogCaptureFixture) -> None:
    sec = Security(capabilities=("NET_RAW", "cap_sys_ptrace"), devices=("c 1:11 r",))
    assert sec.relaxations() == ["capability NET_RAW", "capability SYS_PTRACE", "device c 1:11 r"]
    raw = "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); print('raw')"
    with caplog.at_level(logging.WARNING, logger="bunshin_async.security"):
        async with Workspace(security=sec) as ws:
            assert (await ws.exec(["python3", "-c", raw])).stdout == "raw\n"
            eff = int((await ws.exec("grep CapEff /proc/self/status")).stdout.split()[1], 16)
            assert eff >> CAPABILITIES.index("SYS_PTRACE") & 1 and not eff >> CAPABILITIES.index("SYS_ADMIN") & 1
    assert any(ws.id in r.getMessage() and "NET_RAW" in r.getMessage() for r in caplog.records)
    async with Workspace() as ws:  # the default: no raw sockets
        assert (await ws.exec(["python3", "-c", raw])).exit_code != 0


async def test_security_off_is_the_hosts_root() -> None:
    off = Security.off()
    assert "seccomp off (and no_new_privs unset)" in off.relaxations()
    async with Workspace(security=off) as ws:
        st = (await ws.exec("grep -E 'CapEff|NoNewPrivs|Seccomp:' /proc/self/status")).stdout.split()
        assert st[st.index("NoNewPrivs:") + 1] == "0" and st[st.index("Seccomp:") + 1] == "0"
        assert (await ws.exec("test -w /proc/sys/kernel/core_pattern")).exit_code == 0
        assert ws.cgroup is not None
        devices = next(d for d in ws.cgroup.dirs if d.parent.parent.name == "devices")
        assert (devices / "devices.list").read_text().strip() == "a *:* rwm"


async def test_seccomp_off_alone_keeps_the_reduced_capabilities() -> None:
    async with Workspace(security=Security(seccomp=False)) as ws:
        r = await ws.exec("grep -E 'NoNewPrivs|Seccomp:' /proc/self/status; mount -t tmpfs none /mnt")
        assert "Seccomp:\t0" in r.stdout and r.exit_code != 0  # no CAP_SYS_ADMIN: mount still fails


def test_bad_settings_are_security_errors() -> None:
    with pytest.raises(SecurityError) as exc:
        Security(capabilities=("SYS_GODMODE",))
    assert exc.value.field == "capabilities"
    with pytest.raises(SecurityError):
        Security(devices=("c 1:3 rwx",))
    copy = pickle.loads(pickle.dumps(exc.value))
    assert isinstance(copy, SecurityError) and copy.field == "capabilities"
    with pytest.raises(ValueError):
        Limits(nofile=8)
    with pytest.raises(ValueError):
        Limits(disk=1024)


def test_doctor_says_what_the_host_enforces() -> None:
    checks = {c.name: c for c in security_checks()}
    assert checks["seccomp"].ok and checks["no_new_privs"].ok and checks["device allow-list"].ok
    userns = checks["user namespace per workspace"]
    assert userns.ok and "host uid 100000" in userns.detail, userns
