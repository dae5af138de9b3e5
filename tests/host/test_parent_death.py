"""``bunshin-init``'s parent-death signal (native/init.c ``die_with_parent``, ``_criu.PARENT_ENV``), which every CRIU
call runs through: the program it execs dies with the host process, and one whose host died before the signal was
set never runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bunshin_async._host import _paths
from bunshin_async._host._criu import PARENT_ENV

pytestmark = pytest.mark.unit

PDEATHSIG = (  # PR_GET_PDEATHSIG
    "import ctypes, os; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v)); "
    "print(v.value, os.environ.get('{env}'))"
)


def _join(*cmd: str, parent: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, PARENT_ENV: str(parent)}
    argv = [str(_paths.init_binary()), "--join", "--", *cmd]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)


def test_the_command_runs_with_sigkill_as_its_parent_death_signal() -> None:
    r = _join(sys.executable, "-c", PDEATHSIG.format(env=PARENT_ENV), parent=os.getpid())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["9", "None"]  # SIGKILL (PR_GET_PDEATHSIG), and the variable is not passed on


def test_a_host_already_gone_runs_nothing() -> None:
    """Another parent than the one named: the host died before the prctl and this process was reparented."""
    r = _join("/bin/echo", "ran", parent=os.getpid() + 1)
    assert (r.returncode, r.stdout) == (1, "")


def test_the_command_dies_with_its_host() -> None:
    host = (
        "import os, subprocess, sys\n"
        f"p = subprocess.Popen([{str(_paths.init_binary())!r}, '--join', '--', '/bin/sleep', '600'],"
        f" env={{**os.environ, {PARENT_ENV!r}: str(os.getpid())}})\n"
        "print(p.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen([sys.executable, "-c", host], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout is not None
            pid = int(p.stdout.readline())
            deadline = time.monotonic() + 30  # hang guards: an exec and a kill take milliseconds
            while _comm(pid) != "sleep" and time.monotonic() < deadline:  # past the prctl: exec'd
                time.sleep(0.005)
            assert _comm(pid) == "sleep"
        finally:
            p.kill()
    deadline = time.monotonic() + 30
    while _comm(pid) == "sleep" and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _comm(pid) != "sleep", "the command outlived its host"


def _comm(pid: int) -> str:
    """The process's name, or "" once it is gone or a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    return "" if "zombie" in status else status.split("\n", 1)[0].split("\t")[1]
