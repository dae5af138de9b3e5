"""CRIU's zdtm static tests through Bunshin's fork (issue 39): each test runs in a workspace, is snapshotted twice
while it runs (with ``BUNSHIN_TRACK_WRITES=1``: a pre-copy plus a dump, then an incremental dump), a copy is restored
from the second snapshot, and a second copy is snapshotted twice itself and copied again; then SIGTERM to the test in
the source, in both copies and in the copy of the copy, each of which must write PASS (zdtm's own check of its
state). Not part of ``make test``: it needs CRIU's source tree (criu/.build/src, left by criu/build.sh) to build the
tests, statically, so that any workspace image runs them.

    BUNSHIN_TRACK_WRITES=1 .venv/bin/python scripts/zdtm_fork.py [--src criu/.build/src] [TEST ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import anyio

from bunshin_async import Snapshot, Workspace

TESTS = (
    "mem-touch maps00 maps02 maps04 maps05 mprotect00 sigaltstack sleeping00 zombie00 pthread00 futex xids00 cow00 "
    "pipe00 session00 write_read00 file_shared msgque sem shm"
).split()
"""Memory (mem-touch writes random pages while it is checkpointed), mappings, signals, process states, files, SysV
IPC objects (the workspace's IPC namespace, which CRIU dumps in place: criu/patches/0019)."""
FILE_TESTS = {"maps00", "maps06", "file_shared", "unlink_mmap00", "write_read00", "write_read01", "cow01"}


def build(src: Path, tests: list[str], out: Path) -> None:
    """Build the zdtm library and ``tests`` statically from a copy of ``src``'s test tree into ``out``."""
    tree = out / "src"
    shutil.copytree(src / "test", tree / "test", symlinks=True)
    shutil.copytree(src / "include", tree / "include", symlinks=True)
    zdtm = tree / "test" / "zdtm"
    subprocess.run(["make", "-s", "-C", str(zdtm / "lib")], check=True)
    subprocess.run(["make", "-s", "-C", str(zdtm / "static"), "LDFLAGS=-static", *tests], check=True)
    for t in tests:
        shutil.copy2(zdtm / "static" / t, out / t)


async def _term_and_check(ws: Workspace, t: str) -> str:
    """SIGTERM the test, wait for it to exit, and say PASS or what its output ends with."""
    r = await ws.exec(f"kill -TERM $(cat /workspace/{t}.pid)")
    if r.exit_code:
        return f"kill failed: {r.stderr.strip()}"
    with anyio.fail_after(30):
        while (await ws.exec(f"kill -0 $(cat /workspace/{t}.pid) 2>/dev/null")).exit_code == 0:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    out = (await ws.exec(f"grep -E 'PASS|FAIL|differs' /workspace/{t}.out | tail -5")).stdout
    return "PASS" if "PASS" in out and "FAIL" not in out else out[-400:]


async def _second_snapshot(ws: Workspace) -> Snapshot:
    """Two snapshots of the running test a moment apart (the second incremental on the first, tracked or not); the
    first is let go, the second returned."""
    await anyio.sleep(0.3)
    first = await ws.snapshot()
    try:
        await anyio.sleep(0.3)
        return await ws.snapshot()
    finally:
        await first.aclose()


async def run_one(bindir: Path, t: str) -> dict[str, str]:
    res: dict[str, str] = {}
    async with Workspace() as ws:
        await ws.write_file(f"/workspace/{t}", (bindir / t).read_bytes(), mode=0o755)
        extra = f" --filename=/workspace/{t}.file" if t in FILE_TESTS else ""
        r = await ws.exec(f"cd /workspace && ./{t} --pidfile={t}.pid --outfile={t}.out{extra}", timeout=60)
        if r.exit_code:  # it daemonizes: the starter exits 0 once the test is ready
            return {"start": f"exit {r.exit_code}: {r.stderr[-300:]}"}
        async with AsyncExitStack() as stack:  # every copy made is closed, whichever step fails
            s2 = await _second_snapshot(ws)
            try:
                [c] = await Workspace.from_snapshot(s2)
                stack.push_async_callback(c.aclose)
                [c2] = await Workspace.from_snapshot(s2)
                stack.push_async_callback(c2.aclose)
            finally:
                await s2.aclose()
            s4 = await _second_snapshot(c2)
            try:
                [c3] = await Workspace.from_snapshot(s4)
                stack.push_async_callback(c3.aclose)
            finally:
                await s4.aclose()
            res["copy of a copy's 2nd snapshot"] = await _term_and_check(c3, t)
            res["copy after its snapshots"] = await _term_and_check(c2, t)
            res["copy of the 2nd snapshot"] = await _term_and_check(c, t)
        res["source"] = await _term_and_check(ws, t)
    return res


async def run(bindir: Path, tests: list[str]) -> list[str]:
    failed = []
    for t in tests:
        t0 = time.monotonic()
        try:
            res = await run_one(bindir, t)
        except Exception as exc:  # a report of every test, not the first failure
            res = {"error": repr(exc)[:500]}
        if not res or any(v != "PASS" for v in res.values()):
            failed.append(t)
        print(t, json.dumps(res), f"{time.monotonic() - t0:.1f}s", flush=True)
    return failed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parent.parent / "criu" / ".build" / "src")
    ap.add_argument("tests", nargs="*", default=TESTS)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zdtm-fork-") as tmp:
        build(args.src, args.tests, Path(tmp))
        failed = anyio.run(run, Path(tmp), args.tests)
    print(json.dumps({"tests": len(args.tests), "failed": failed}))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
