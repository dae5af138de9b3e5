"""Load and memory pressure on 2 cores (issue #20, item 4): a group of forks inside a cgroup with a tight memory
limit, where copies that run past it die alone (the kernel's OOM killer picks them) while their siblings and the
parent carry on; 64 concurrent forks and 256 concurrent execs, each finished or failed with a timeout within its
deadline (no deadlock)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import anyio
import pytest

from bunshin_async import ToolTimeout, Workspace
from bunshin_async._host._kernel import CGROUP_ROOT, V1_CONTROLLERS, cgroup_version, parent_name
from tests.reliability.campaign import holding_workspace

pytestmark = [pytest.mark.root, pytest.mark.slow]

GROUP_LIMIT_MIB = 512
HOG_MIB = 1024


@pytest.fixture
def tight_parent(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every workspace made in the test lives under one cgroup limited to ``GROUP_LIMIT_MIB`` (memory and swap)."""
    assert cgroup_version() == 1, "this machine's CI uses cgroup v1"
    name = f"{parent_name()}/pressure-{secrets.token_hex(3)}"
    made = []
    for ctrl in V1_CONTROLLERS:
        base = CGROUP_ROOT / ctrl
        if (base / "cgroup.procs").exists():
            (base / name).mkdir(parents=True)
            made.append(base / name)
    mem = CGROUP_ROOT / "memory" / name
    (mem / "memory.limit_in_bytes").write_text(str(GROUP_LIMIT_MIB << 20))
    if (mem / "memory.memsw.limit_in_bytes").exists():
        (mem / "memory.memsw.limit_in_bytes").write_text(str(GROUP_LIMIT_MIB << 20))
    monkeypatch.setenv("BUNSHIN_CGROUP_PARENT", name)
    try:
        yield
    finally:
        for d in made:
            os.rmdir(d)


HOG = f'python3 -c \'b = bytearray({HOG_MIB} << 20); b[::4096] = b"x" * len(b[::4096]); print("survived")\''


async def test_copies_past_a_group_limit_die_alone(tight_parent: None) -> None:
    async with Workspace() as ws:
        await holding_workspace(ws)
        copies = await ws.fork(4)
        try:
            results: dict[int, int] = {}

            async def hog(i: int) -> None:
                results[i] = (await copies[i].exec(HOG, timeout=120)).exit_code

            async with anyio.create_task_group() as tg:
                for i in (0, 1):
                    tg.start_soon(hog, i)
            assert sorted(results) == [0, 1] and all(code in (-9, 137) for code in results.values()), results
            for w in (ws, copies[2], copies[3]):  # the siblings and the parent are untouched
                assert (await w.exec("test -e /tmp/ready && echo alive")).stdout == "alive\n"
            for i in (0, 1):  # the hogs' copies lost the hog only, and still serve
                assert (await copies[i].exec("echo ok")).stdout == "ok\n"
        finally:
            for copy in copies:
                await copy.aclose()


DEADLINE = 240.0


async def test_sixty_four_concurrent_forks_and_256_execs() -> None:
    async with Workspace() as ws:
        await holding_workspace(ws)
        outcome = {"forked": 0, "fork_timeouts": 0, "execs": 0, "exec_timeouts": 0}
        copies: list[Workspace] = []

        async def fork() -> None:
            try:
                with anyio.fail_after(DEADLINE):
                    got = await ws.fork(1)
                copies.extend(got)
                outcome["forked"] += 1
            except TimeoutError:
                outcome["fork_timeouts"] += 1

        async def run(i: int) -> None:
            try:
                r = await ws.exec(f"echo {i}", timeout=DEADLINE)
                assert r.stdout == f"{i}\n"
                outcome["execs"] += 1
            except ToolTimeout:
                outcome["exec_timeouts"] += 1

        try:
            with anyio.fail_after(DEADLINE + 60):  # nothing may hang past its deadline
                async with anyio.create_task_group() as tg:
                    for i in range(256):
                        tg.start_soon(run, i)
                        if i % 4 == 0:
                            tg.start_soon(fork)
            assert outcome["forked"] + outcome["fork_timeouts"] == 64
            assert outcome["execs"] + outcome["exec_timeouts"] == 256
            assert outcome["forked"] == 64 and outcome["execs"] == 256, outcome  # on this machine none times out
            for copy in copies[::8]:
                assert (await copy.exec("test -e /tmp/ready && echo alive")).stdout == "alive\n"
        finally:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for copy in copies:
                        tg.start_soon(copy.aclose)
