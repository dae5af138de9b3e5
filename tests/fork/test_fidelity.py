"""Process states survive a fork exactly (issue #20, item 1): stopped processes stay stopped in the copy and resume
on SIGCONT, zombies stay zombies, the process groups of a job-control shell keep their groups and states, a process
that execs in a loop is forked mid-flight; a process that cannot be dumped (one traced by another) fails the fork
within seconds naming it, and the parent carries on. Run in copy-on-write and stock restore modes, and with
write-tracked dumps (``criu-cow+track``)."""

from __future__ import annotations

import signal

import anyio
import pytest

from bunshin_async import ForkError, Workspace
from bunshin_async._fork import _dump

pytestmark = [pytest.mark.fork_modes("criu-cow", "criu"), pytest.mark.tracked]

PS = "ps -eo pid=,ppid=,pgid=,sid=,stat=,args="


async def _procs(ws: Workspace) -> dict[int, tuple[int, int, int, str, str]]:
    """In-workspace pid -> (ppid, pgid, sid, state letter, args), without ps itself and the agent's exec shell."""
    out: dict[int, tuple[int, int, int, str, str]] = {}
    for line in (await ws.exec(PS)).stdout.splitlines():
        pid, ppid, pgid, sid, stat, args = line.split(None, 5)
        if args.startswith("ps -eo"):
            continue
        out[int(pid)] = (int(ppid), int(pgid), int(sid), stat[0], args)
    return out


async def _state(ws: Workspace, pid: int) -> str:
    r = await ws.exec(f"ps -o stat= -p {pid}")
    return r.stdout.strip()[:1]


async def _wait_state(ws: Workspace, pid: int, want: str, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while await _state(ws, pid) != want:
            await anyio.sleep(0.02)


async def test_stopped_process_stays_stopped_and_resumes(ws: Workspace) -> None:
    sleeper = await ws.spawn("sleep 1000")
    await sleeper.signal(signal.SIGSTOP)
    await _wait_state(ws, sleeper.pid, "T")
    with anyio.fail_after(120):  # the stopped process never runs again: a fork waiting for it would never end
        copies = await ws.fork(2)
    try:
        assert await _state(ws, sleeper.pid) == "T", "the parent's stopped process must stay stopped"
        for copy in copies:
            assert await _procs(copy) == await _procs(ws)
            assert await _state(copy, sleeper.pid) == "T"
        await copies[0].exec(f"kill -CONT {sleeper.pid}")
        await _wait_state(copies[0], sleeper.pid, "S")
        assert await _state(copies[1], sleeper.pid) == "T", "a SIGCONT in one copy resumes it there only"
        assert await _state(ws, sleeper.pid) == "T"
        (grandchild,) = await copies[1].fork()  # a fork of a copy holding the stopped process
        try:
            assert await _state(grandchild, sleeper.pid) == "T"
        finally:
            await grandchild.aclose()
    finally:
        for copy in copies:
            await copy.aclose()
    await sleeper.signal(signal.SIGCONT)
    await _wait_state(ws, sleeper.pid, "S")


async def test_zombie_stays_a_zombie(ws: Workspace) -> None:
    code = "import os, time\nif os.fork() == 0:\n    os._exit(3)\ntime.sleep(1000)\n"
    await ws.write_file("/workspace/zombie.py", code)
    parent = await ws.spawn(["python3", "/workspace/zombie.py"])
    with anyio.fail_after(10):
        while not any(p[0] == parent.pid and p[3] == "Z" for p in (await _procs(ws)).values()):
            await anyio.sleep(0.02)
    (copy,) = await ws.fork()
    try:
        procs = await _procs(copy)
        assert procs == await _procs(ws)
        zombies = [pid for pid, p in procs.items() if p[0] == parent.pid and p[3] == "Z"]
        assert len(zombies) == 1
        # The copy's zombie is a real one: when its parent dies there, pid 1 inherits and reaps it.
        await copy.exec(f"kill {parent.pid}")
        with anyio.fail_after(10):
            while zombies[0] in await _procs(copy):
                await anyio.sleep(0.02)
        assert (await _procs(ws))[zombies[0]][3] == "Z", "the parent's zombie is untouched"
    finally:
        await copy.aclose()


async def test_job_control_shell_groups_and_states(ws: Workspace) -> None:
    # A job-control shell (set -m): each job is its own process group; one is stopped with SIGTSTP, one with
    # SIGSTOP, one runs, and the shell waits in the foreground.
    script = (
        "set -m\n"
        "for n in 1001 1002 1003; do\n"
        "  sleep $n &\n"
        '  while [ "$(cat /proc/$!/comm)" != sleep ]; do :; done\n'  # stop the sleep, not the shell's child
        "done\n"
        "kill -TSTP %1\nkill -STOP %2\necho ready > /tmp/ready\nsleep 1004\n"
    )
    await ws.write_file("/workspace/jobs.sh", script)
    shell = await ws.spawn(["bash", "/workspace/jobs.sh"])
    with anyio.fail_after(10):
        while (await ws.exec("cat /tmp/ready")).exit_code != 0:
            await anyio.sleep(0.02)
    before = await _procs(ws)
    jobs = {p[4]: (pid, p) for pid, p in before.items() if p[0] == shell.pid}
    assert {jobs[f"sleep {n}"][1][3] for n in (1001, 1002)} == {"T"}
    assert len({p[1] for _pid, p in jobs.values()}) == 4, "each job has its own process group"
    copies = await ws.fork(2)
    try:
        for copy in copies:
            assert await _procs(copy) == before
        # The stopped job resumes in a copy when its group is continued, as `bg` would.
        pgid = jobs["sleep 1001"][1][1]
        await copies[0].exec(f"kill -CONT -- -{pgid}")
        await _wait_state(copies[0], jobs["sleep 1001"][0], "S")
        assert await _state(copies[1], jobs["sleep 1001"][0]) == "T"
        assert await _procs(ws) == before
    finally:
        for copy in copies:
            await copy.aclose()


async def test_fork_while_a_process_execs_in_a_loop(ws: Workspace) -> None:
    # Forks land at any point of fork + execve of the loop's children (the cgroup freezer stops them wherever).
    await ws.write_file("/workspace/loop.sh", "i=0\nwhile :; do /bin/true; i=$((i+1)); echo $i > /tmp/n; done\n")
    await ws.spawn(["sh", "/workspace/loop.sh"])
    for _ in range(5):
        (copy,) = await ws.fork()
        try:
            first = int((await copy.exec("cat /tmp/n")).stdout or 0)
            with anyio.fail_after(10):
                while int((await copy.exec("cat /tmp/n")).stdout or 0) <= first + 3:
                    await anyio.sleep(0.02)
        finally:
            await copy.aclose()


TRACER = """
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
child = os.fork()
if child == 0:
    os.execvp("sleep", ["sleep", "1000"])
while open(f"/proc/{child}/comm").read() != "sleep\\n":  # attach once it runs sleep (the name the error gives)
    time.sleep(0.01)
if libc.ptrace(16, child, 0, 0):  # PTRACE_ATTACH
    raise SystemExit(os.strerror(ctypes.get_errno()))
os.waitpid(child, 0)
libc.ptrace(7, child, 0, 0)  # PTRACE_CONT
open("/tmp/traced.tmp", "w").write(str(child))
os.rename("/tmp/traced.tmp", "/tmp/traced")  # whole: a reader never sees it empty
time.sleep(1000)
"""


@pytest.mark.parametrize("checked_first", [True, False], ids=["sdk-check", "criu-check"])
async def test_traced_process_fails_the_fork_fast_naming_it(
    ws: Workspace, checked_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not checked_first:  # a tracer that attaches after the SDK's check: CRIU itself (criu/patches/0008) fails
        check = _dump._undumpable
        monkeypatch.setattr(_dump, "_undumpable", lambda ws, after_failure: after_failure and check(ws, True))
    await ws.write_file("/workspace/tracer.py", TRACER)
    tracer = await ws.spawn(["python3", "/workspace/tracer.py"])
    with anyio.fail_after(10):
        while (r := await ws.exec("cat /tmp/traced")).exit_code != 0:
            await anyio.sleep(0.02)
    tracee = int(r.stdout)
    with pytest.raises(ForkError) as info, anyio.fail_after(120):  # fails, rather than waiting for the tracer
        await ws.fork()
    message = str(info.value)
    if not checked_first:
        assert "a traced task cannot be dumped" in message, message
    assert f"pid {tracee} (sleep)" in message and f"traced by pid {tracer.pid} (python3)" in message, message
    # The parent is unharmed: both processes run on, tools work, and once the tracer is gone a fork works.
    procs = await _procs(ws)
    assert procs[tracee][3] == "S" and procs[tracer.pid][3] == "S"
    assert (await ws.exec("echo ok")).stdout == "ok\n"
    await ws.exec(f"kill -9 {tracer.pid}")  # the tracer only: its tracee is detached and runs on
    with anyio.fail_after(10):
        while tracer.pid in await _procs(ws):
            await anyio.sleep(0.02)
    (copy,) = await ws.fork()
    try:
        assert (await copy.exec(f"ps -o args= -p {tracee}")).stdout.strip() == "sleep 1000"
    finally:
        await copy.aclose()
