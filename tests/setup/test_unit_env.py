"""scripts/unit-env.sh run several times at once by one user (two ``make test-unit``): the environment is made once,
and a remake for a changed lock waits for the run still using the old one. The script runs for real (bash, flock)
from a copy of the checkout's layout, over a stand-in ``python3`` that makes a stand-in environment, logs what it is
asked and holds at gates the test opens: no network, no pip. What is waiting is told by the state of its processes
(a ``flock`` child blocked on the lock), never by a time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "unit-env.sh"

# python3 as the script uses it: -c (version checks) is the real one; -m venv makes an environment whose python is
# this file again; -m pip logs and holds at the gate "pip"; anything else is a run: logged, held at "run-$TAG".
STUB = f"""#!/usr/bin/env bash
if [[ $1 == -c ]]; then exec {sys.executable} "$@"; fi
if [[ $1 == -m && $2 == venv ]]; then echo venv >>"$LOG"; mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
if [[ $1 == -m && $2 == pip ]]; then
    echo pip >>"$LOG"
    while [[ ! -e $GATES/pip ]]; do sleep 0.01; done
    exit 0
fi
echo "run $TAG" >>"$LOG"
while [[ ! -e $GATES/run-$TAG ]]; do sleep 0.01; done
echo "end $TAG" >>"$LOG"
"""


class Checkout:
    """A copy of the script in a checkout layout of its own (its requirements.lock can change), its stand-in
    python3, the log and the gates."""

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "checkout"
        (self.root / "scripts").mkdir(parents=True)
        shutil.copy(SCRIPT, self.root / "scripts" / "unit-env.sh")
        (self.root / "requirements.lock").write_text("anyio==4.0\n")
        self.python = tmp / "python3"
        self.python.write_text(STUB)
        self.python.chmod(0o755)
        self.env = tmp / "cache" / "unit-venv"
        self.log = tmp / "log"
        self.log.touch()
        self.gates = tmp / "gates"
        self.gates.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []

    def run(self, tag: str) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "PYTHON": str(self.python),
            "BUNSHIN_UNIT_VENV": str(self.env),
            "LOG": str(self.log),
            "GATES": str(self.gates),
            "TAG": tag,
        }
        proc = subprocess.Popen(
            ["bash", str(self.root / "scripts" / "unit-env.sh"), "-m", "pytest"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def open(self, gate: str) -> None:
        (self.gates / gate).touch()

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def until(self, what: str, done: object) -> None:
        """Wait (polling; 60 s at most, a hang's bound, not an assertion on speed) until ``done()`` holds."""
        deadline = time.monotonic() + 60
        while not done():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"never: {what}; log {self.lines()}"
            time.sleep(0.01)


def _waits_on_flock(proc: subprocess.Popen[bytes], *argv: str) -> bool:
    """``proc`` (the script's bash) has a child ``flock ARGV``: it is taking that lock (the one a test holds
    elsewhere: it waits there until the test lets go)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
            cmdline = (d / "cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(proc.pid) and [c.decode() for c in cmdline] == ["flock", *argv]:
            return True
    return False


@pytest.fixture
def checkout(tmp_path: Path) -> Iterator[Checkout]:
    if shutil.which("flock") is None:
        pytest.fail("flock (util-linux) is missing: the script needs it")
    c = Checkout(tmp_path)
    try:
        yield c
    finally:
        for gate in ("pip", "run-a", "run-b"):
            c.open(gate)
        for p in c.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_two_runs_at_once_make_the_environment_once(checkout: Checkout) -> None:
    a = checkout.run("a")
    checkout.until("a makes the environment", lambda: "pip" in checkout.lines())
    b = checkout.run("b")
    # b waits for a's make (the maker's lock, fd 8; without it b would make its own: a second 'venv' in the log)
    checkout.until("b waits or makes", lambda: _waits_on_flock(b, "8") or checkout.lines().count("venv") > 1)
    checkout.open("pip")
    checkout.open("run-a")
    checkout.open("run-b")
    assert a.wait(60) == 0 and b.wait(60) == 0
    lines = checkout.lines()
    assert lines[:2] == ["venv", "pip"] and lines.count("venv") == 1 and lines.count("pip") == 1, lines
    assert sorted(lines[2:]) == ["end a", "end b", "run a", "run b"], lines
    assert (checkout.env / ".unit-sum").is_file()


def test_a_remake_for_a_changed_lock_waits_for_the_run_using_the_old_environment(checkout: Checkout) -> None:
    checkout.open("pip")
    a = checkout.run("a")
    checkout.until("a runs", lambda: "run a" in checkout.lines())
    (checkout.root / "requirements.lock").write_text("anyio==4.1\n")  # the next run needs another environment
    b = checkout.run("b")
    # b waits until no run uses the environment it replaces (ENV.lock exclusive, fd 9; a holds it shared)
    checkout.until("b waits or remakes", lambda: _waits_on_flock(b, "9") or checkout.lines().count("venv") > 1)
    assert (checkout.env / "bin" / "python").is_file()  # a's environment is still there while a runs
    checkout.open("run-a")
    assert a.wait(60) == 0
    checkout.open("run-b")
    assert b.wait(60) == 0
    assert checkout.lines() == ["venv", "pip", "run a", "end a", "venv", "pip", "run b", "end b"]


def test_the_path_is_printed_without_arguments_and_the_environment_kept(checkout: Checkout) -> None:
    checkout.open("pip")
    env = {**os.environ, "PYTHON": str(checkout.python), "BUNSHIN_UNIT_VENV": str(checkout.env),
           "LOG": str(checkout.log), "GATES": str(checkout.gates)}  # fmt: skip
    script = str(checkout.root / "scripts" / "unit-env.sh")
    first = subprocess.run(["bash", script], env=env, capture_output=True, text=True, check=True)
    again = subprocess.run(["bash", script], env=env, capture_output=True, text=True, check=True)
    assert first.stdout == again.stdout == f"{checkout.env}/bin/python\n"
    assert checkout.lines() == ["venv", "pip"]  # made once, then found made
