"""Every escape attempt runs as root in a fresh workspace and in a live fork of one (``box``); ``host`` records
what the attempt must not change, read on the host side."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from bunshin_async import Limits, Security, Workspace

ATTEMPTS = (Path(__file__).parent / "attempts.py").read_bytes()
SYSCTLS = ("kernel/core_pattern", "vm/swappiness", "kernel/pid_max", "vm/overcommit_memory", "kernel/hostname")


def _read(path: str) -> str:
    return Path(path).read_text()


OTHERS = ("/dev/shm/", "/tmp/bunshin-test-", "/var/lib/docker", "/run/docker", "/var/lib/containers")
"""Where other work on this machine mounts (snapshot stores and workspace disks of other test runs, Docker, podman)."""


def _other_workspace_disk(point: str, fstype: str, source: str) -> bool:
    """A workspace's disk (``Limits.disk``, on by default) of another run on this machine (this run's own are under
    ``OTHERS``' /tmp/bunshin-test-): a tmpfs named bunshin-disk on ``<run dir>/ws/<workspace id>``, wherever that
    run keeps its workspaces. By its place, not by the ``owner`` file inside: the workspace writes that file only
    after the mount, and a run beside this one (``make run`` during a CI run) can be caught in between."""
    parent, name = os.path.split(point)
    return (
        fstype == "tmpfs"
        and source == "bunshin-disk"
        and os.path.basename(parent) == "ws"
        and re.fullmatch(r"[0-9a-f]{12}", name) is not None
    )


def _mounts() -> set[str]:
    """The host mount table (mount point, type, source), without what other work on the machine mounts."""
    out = set()
    for line in _read("/proc/self/mountinfo").splitlines():
        fields = line.split()
        sep = fields.index("-")
        point, fstype, source = fields[4], fields[sep + 1], fields[sep + 2]
        if not point.startswith(OTHERS) and not _other_workspace_disk(point, fstype, source):
            out.add(f"{point} {fstype} {source}")
    return out


class Host:
    """The host as it was before the attempt: sysctls, mounts, clock, and a host process that must survive."""

    def __init__(self) -> None:
        self.sysctls = {k: _read(f"/proc/sys/{k}") for k in SYSCTLS}
        self.ksm = _read("/sys/kernel/mm/ksm/run")
        self.mounts = _mounts()
        self.clock = (time.time(), time.monotonic())
        self.sentinel = subprocess.Popen(["sleep", "600"])

    def sysctl(self, key: str) -> str:
        return self.sysctls[key].strip()

    def assert_unchanged(self) -> None:
        assert {k: _read(f"/proc/sys/{k}") for k in SYSCTLS} == self.sysctls
        assert _read("/sys/kernel/mm/ksm/run") == self.ksm
        new = _mounts() - self.mounts
        assert not new, f"new mounts in the host's mount table: {new}"
        wall, mono = time.time() - self.clock[0], time.monotonic() - self.clock[1]
        assert abs(wall - mono) < 0.5, f"the host clock moved: {wall:.3f} s of wall time in {mono:.3f} s"
        assert self.sentinel.poll() is None, "a host process died"
        status = _read(f"/proc/{self.sentinel.pid}/status")
        assert "TracerPid:\t0\n" in status, "a host process is being traced"

    def close(self) -> None:
        self.sentinel.kill()
        self.sentinel.wait()


@pytest.fixture
def host() -> Iterator[Host]:
    h = Host()
    try:
        yield h
        h.assert_unchanged()
    finally:
        h.close()


class Box:
    """Where an attempt runs: ``ws`` (a workspace, or a fork of ``parent``)."""

    def __init__(self, ws: Workspace, parent: Workspace | None) -> None:
        self.ws = ws
        self.parent = parent

    async def attempt(self, name: str, *args: object, timeout: float = 60) -> dict[str, Any]:
        r = await self.ws.exec(["python3", "/workspace/attempts.py", name, *map(str, args)], timeout=timeout)
        assert r.exit_code == 0 and r.stdout, f"{name}: exit {r.exit_code}, {r.stdout!r} {r.stderr!r}"
        result: dict[str, Any] = json.loads(r.stdout.splitlines()[-1])
        return result


@asynccontextmanager
async def inside(where: str, limits: Limits | None = None, security: Security | None = None) -> AsyncIterator[Box]:
    async with Workspace(limits=limits, security=security) as ws:
        await ws.write_file("/workspace/attempts.py", ATTEMPTS)
        if where == "workspace":
            yield Box(ws, None)
            return
        (copy,) = await ws.fork()
        try:
            assert copy.fork_mode.startswith("criu")
            assert security is None or copy.security == security
            yield Box(copy, ws)
        finally:
            await copy.aclose()


@pytest.fixture(params=["workspace", "fork"])
def where(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def box(where: str) -> AsyncIterator[Box]:
    async with inside(where) as b:
        yield b


def host_root_device() -> tuple[int, int]:
    dev = os.stat("/").st_dev
    return os.major(dev), os.minor(dev)
