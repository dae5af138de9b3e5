"""Cache on vs off: a seeded random sequence of reads and writes on a real workspace gives the same results and
the same final workspace state (files and processes) with a cache pre-warmed by a sibling rollout as without any
cache; with a ``ForkStateProvider`` the sibling's writes are served by restoring forks of its snapshots."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bunshin_async import ExecResult, ToolError, Workspace
from bunshin_async._rollout._state import workspace_state
from bunshin_async.cache import CachedSession, ForkStateProvider, ToolCache
from bunshin_async.tools import builtin_tools

pytestmark = pytest.mark.usefixtures("need_workspaces")

FILES = ["a.txt", "b.txt", "src/c.py", "src/d.py", "notes/e.md"]
WORDS = ["alpha", "beta", "gamma", "delta", "needle", "haystack"]


def random_calls(seed: int, n: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    calls: list[tuple[str, dict[str, Any]]] = []
    for _ in range(n):
        f, g, w = rng.choice(FILES), rng.choice(FILES), rng.choice(WORDS)
        calls.append(
            rng.choice(
                [
                    # writes
                    ("write_file", {"path": f, "content": f"{w}\n" * rng.randint(1, 4)}),
                    ("write_file", {"path": f, "content": f"{w} appended\n", "append": True}),
                    ("bash", {"command": f"mkdir -p $(dirname {f}) && echo {w} >> {f}"}),
                    ("bash", {"command": f"sed -i 's/{w}/{w.upper()}/g' {f} 2>/dev/null; true"}),
                    ("python", {"code": f"open('{f}', 'a').write('{w} from python\\n') if True else None"}),
                    ("bash", {"command": f"python3 -c 'import time; time.sleep(1e6)' {w} >/dev/null 2>&1 &"}),
                    # reads
                    ("read_file", {"path": f}),
                    ("list_dir", {"path": "src"}),
                    ("bash", {"command": f"cat {f} {g} 2>&1 | wc -l"}),
                    ("bash", {"command": f"grep -rn {w} . | sort"}),
                    ("bash", {"command": "ls -R . | head -50"}),
                    ("bash", {"command": f"head -n 2 {f}; tail -n 1 {g}"}),
                ]
            )
        )
    return calls


def view(outcome: Any) -> Any:
    if isinstance(outcome, BaseException):
        return (type(outcome).__name__, str(outcome))
    if isinstance(outcome, ExecResult):
        return (outcome.exit_code, outcome.stdout, outcome.stderr, outcome.truncated)  # not the duration
    return outcome


async def run_cached(session: CachedSession, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    out = []
    for name, args in calls:
        try:
            out.append(view(await session.call(name, args)))
        except ToolError as exc:
            out.append(view(exc))
    return out


async def run_plain(ws: Workspace, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    tools = {t.name: t for t in builtin_tools()}
    out = []
    for name, args in calls:
        tool = tools[name]
        assert tool.handler is not None
        try:
            out.append(view(await tool.handler(ws, tool.normalize(args))))
        except ToolError as exc:
            out.append(view(exc))
    return out


@pytest.mark.parametrize("fork", [False, True], ids=["no-provider", "fork-provider"])
@pytest.mark.parametrize(("seed", "diverge_at"), [(1, None), (2, None), (3, 12)])
async def test_cache_on_and_off_agree(seed: int, diverge_at: int | None, fork: bool) -> None:
    calls = random_calls(seed, 60)
    sibling_calls = calls if diverge_at is None else calls[:diverge_at] + random_calls(seed + 1000, 60)
    async with ToolCache(provider=ForkStateProvider() if fork else None) as cache:
        async with Workspace() as ws, cache.session(ws) as sibling:
            await run_cached(sibling, sibling_calls)  # the sibling warms the cache
        async with Workspace() as ws, cache.session(ws) as session:
            cached = await run_cached(session, calls)
            cached_state = await workspace_state(session.workspace)
    async with Workspace() as ws:
        plain = await run_plain(ws, calls)
        plain_state = await workspace_state(ws)

    assert cached == plain
    assert plain_state.startswith("0\n"), plain_state  # the probe ran
    assert cached_state == plain_state
    hits = [r for r in session.history if r.hit]
    reads = [r for r in session.history if r.effect in ("read", "pure")]
    writes = [r for r in session.history if r.effect == "write"]
    restored = [r for r in writes if r.source == "restored"]
    print(f"seed={seed} calls={len(calls)} hits={len(hits)} reads={len(reads)} writes={len(writes)} "
          f"restored={len(restored)}")  # fmt: skip
    if not fork:
        assert hits and all(r.effect == "read" for r in hits)  # read hits only: no provider, writes ran
    elif diverge_at is None:
        assert restored == writes and "python3 -c" in cached_state  # every write forked, processes included
    else:
        assert 0 < len(restored) < len(writes)  # the shared prefix forked, the rest ran
    if diverge_at is None:
        assert len(hits) == len(reads) + len(restored)  # the sibling made the same calls: every read hits
