"""``run_agent`` with speculation, through a ``CachedSession`` (real workspaces and forks, the replay server and the
real ``openai`` SDK): the same trajectory and final files as without speculation, cache hits (write hits restored
into forks) still served, and a write predicted from a sibling rollout committed and adopted by the session."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from bunshin_async import ToolCallError, Workspace
from bunshin_async.agent import WorkspaceExecutor, run_agent
from bunshin_async.cache import CachedSession, ForkStateProvider, ToolCache
from bunshin_async.rollout import Step
from bunshin_async.speculation import Speculation
from bunshin_async.tools import builtin_tools
from speculator import CostAwarePolicy, NgramModel, Rule, RulePredictor, SiblingTable, default_speculation

from .conftest import bash, final, trajectory

TOOLS = builtin_tools()
FILES = "cd /workspace && find . -xdev -type f -print0 | sort -z | xargs -0 -r sha256sum"


def _observations(traj: Any) -> list[tuple[str | None, Any, str | None]]:
    return [(s.tool, s.args, s.observation) for s in traj.steps]


async def _files(ws: Workspace) -> str:
    r = await ws.exec(FILES, timeout=30)
    assert r.exit_code == 0, r.stderr
    return r.stdout


SCRIPT = [
    bash("ls", llm=0.2, turn=0),
    bash("echo one > a.txt", llm=0.3, turn=1),
    bash("cat a.txt", llm=0.2, turn=2),
    bash("sleep 0.2; echo three >> a.txt", llm=0.4, turn=3),
    bash("cat a.txt b.txt", llm=0.2, turn=4),  # b.txt is missing: a tool error, recorded as any other result
    final(),
]

RULES = [
    Rule(at_start=True, then_tool="bash", then_args={"command": "ls"}, expected_seconds=1.0),
    Rule(after="^ls$", then_tool="bash", then_args={"command": "echo one > a.txt"}, expected_seconds=1.0),
    Rule(
        after="^ls$",
        then_tool="bash",
        then_args={"command": "echo wrong > a.txt"},
        probability=0.5,
        expected_seconds=1.0,
    ),  # fmt: skip
    Rule(
        after="^cat a.txt$",
        then_tool="bash",
        then_args={"command": "sleep 0.2; echo three >> a.txt"},
        expected_seconds=1.0,
    ),  # fmt: skip
]


async def test_speculation_with_a_cached_session_agrees_with_the_plain_loop(serve: Any) -> None:
    trajs = [trajectory("agree", SCRIPT, rollout=i) for i in range(2)]
    async with serve(trajs) as client:
        with anyio.fail_after(30):
            async with Workspace() as ws:
                plain = await run_agent(client, "replay:agree:0", "t", ws, tools=TOOLS, task_id="agree")
                plain_files = await _files(ws)
            # memory not weighed: the coin-flip write must launch (to be rolled back), whatever its fork holds
            policy = CostAwarePolicy(
                default_seconds=1.0, fork_weight=0.2, memory_weight=0.0, contention=None, loop_load=None
            )
            table = SiblingTable()
            async with ToolCache(provider=ForkStateProvider()) as cache:
                runs = []
                for i in range(2):  # rollout 1 is served from the cache (its writes restored into forks)
                    spec = default_speculation(group="agree", table=table, policy=policy, model=NgramModel(),
                                               rules=RULES)  # fmt: skip
                    async with Workspace() as ws, cache.session(ws, TOOLS, salt="agree") as session:
                        result = await run_agent(client, f"replay:agree:{i}", "t", session, speculation=spec,
                                                 task_id="agree", rollout=i)  # fmt: skip
                        runs.append((result, await _files(session.workspace), spec, session))
                m = cache.metrics()
    assert plain.stop_reason == "stop" and len(plain.steps) == len(SCRIPT)
    assert plain.steps[-2].observation == "exit code 1\none\nthree\ncat: b.txt: No such file or directory\n"
    for result, files, _, _ in runs:
        assert _observations(result) == _observations(plain)
        assert files == plain_files
    (first, _, spec0, session0), (_, _, spec1, session1) = runs
    # Rollout 0 ran speculatively: the rules' right guesses were committed (the ``ls`` read in place, both writes
    # in forks that the session adopted and captured), the wrong one was discarded.
    assert spec0.metrics.committed >= 2 and spec0.metrics.wasted + spec0.metrics.failed >= 1
    assert [r.source for r in session0.history].count("adopted") == spec0.metrics.committed
    # Rollout 1: the writes were cache hits restored into forks (the handle followed the session's workspace), the
    # reads stored hits; nothing the cache served was speculated (only the wrong write was).
    assert [r.source for r in session1.history] == ["cache", "restored", "cache", "restored", "cache"]
    assert spec1.metrics.committed == 0 and spec1.metrics.launched == spec1.metrics.wasted + spec1.metrics.failed
    assert m.restores == 2 and m.captures == 2


async def test_an_unknown_tool_is_the_same_error_with_and_without_speculation(serve: Any) -> None:
    """Both paths raise the one ``ToolCallError`` (``_tools.lookup``), not an exception group; the turn's branches
    (a write predicted by the rule, run in a fork) are closed on the way out (the leak fixture checks)."""
    script = [bash("ls", llm=0.1, turn=0), Step("browse", {"url": "x"}, llm_seconds=0.3, turn=1), final()]
    rules = [Rule(after="^ls$", then_tool="bash", then_args={"command": "echo x > f"}, expected_seconds=1.0)]
    async with serve([trajectory("unknown", script)]) as client, Workspace() as ws:
        with pytest.raises(ToolCallError) as plain:
            await run_agent(client, "replay:unknown:0", "t", ws, tools=TOOLS)
        spec = default_speculation(group="unknown", model=NgramModel(), rules=rules)
        executor = WorkspaceExecutor(ws, TOOLS)
        with pytest.raises(ToolCallError) as speculative:
            await run_agent(client, "replay:unknown:0", "t", executor, speculation=spec, task_id="unknown")
        await executor.aclose()
    assert str(plain.value) == "unknown tool 'browse'; known: bash, list_dir, python, read_file, write_file"
    assert str(speculative.value) == str(plain.value) and speculative.value.tool_name == "browse"


SIBLING_SCRIPT = [
    bash("echo base > f", llm=0.1, turn=0),
    bash("sleep 0.6; echo x >> f", llm=0.9, turn=1),
    bash("cat f", llm=0.1, turn=2),
    final(),
]


async def test_a_write_predicted_from_a_sibling_is_committed_and_adopted(serve: Any) -> None:
    trajs = [trajectory("sib", SIBLING_SCRIPT, rollout=i) for i in range(2)]
    table, policy = SiblingTable(), CostAwarePolicy(contention=None, loop_load=None, memory_weight=0.0)
    # Writes under a second are not captured: the cache re-runs them, so speculation may run them ahead.
    async with serve(trajs) as client, ToolCache(provider=ForkStateProvider(), capture_min_duration=1.0) as cache:
        results = []
        for i in range(2):
            spec = default_speculation(group="sib", table=table, policy=policy, model=NgramModel())
            async with Workspace() as ws:
                session = cache.session(ws, TOOLS, own=True, salt="sib")
                try:
                    with anyio.fail_after(30):
                        traj = await run_agent(client, f"replay:sib:{i}", "t", session, speculation=spec,
                                               max_turns=10, task_id="sib", rollout=i)  # fmt: skip
                    live = session.detach()  # the rollout's live workspace, as the group takes it back
                    content = await live.read_file("f")
                    files = await _files(live)
                finally:
                    await session.aclose()
                if live is not ws:
                    await live.aclose()
            results.append((traj, spec, session, content, files, live is ws))
        m = cache.metrics()
    (t0, spec0, s0, c0, f0, same0), (t1, spec1, s1, c1, f1, same1) = results
    assert spec0.metrics.committed == 0 and same0  # nothing to learn from yet
    assert spec1.metrics.committed >= 1  # the siblings are the only predictor with anything to say (empty n-grams)
    assert _observations(t1) == _observations(t0)
    assert c0 == c1 == b"base\nx\n" and f0 == f1
    # The committed write is the session's: the rollout lives in the adopted fork, and the session advanced its
    # state chain, so the read after it was served from what rollout 0 stored.
    assert not same1
    assert [r.source for r in s1.history][1] == "adopted" and s1.state == s0.state
    assert s1.history[2].source == "cache"
    assert m.by_effect["read"].hits == 1


@pytest.mark.parametrize("closed", [False, True])
async def test_workspace_executor_adopts_a_fork(closed: bool) -> None:
    async with Workspace() as ws:
        executor = WorkspaceExecutor(ws, TOOLS)
        [fork] = await ws.fork(1)
        await executor.adopt(fork, "bash", {"command": "true"}, None, 0.0)
        assert executor.workspace is fork and not ws.closed
        if closed:
            await executor.aclose()
            assert fork.closed
        else:
            assert executor.detach() is fork
            await executor.aclose()
            assert not fork.closed
            await fork.aclose()


async def test_plain_workspace_with_speculation_is_refused() -> None:
    async with Workspace() as ws:
        with pytest.raises(ValueError, match="WorkspaceExecutor"):
            await run_agent(None, "m", "t", ws, speculation=Speculation(predictors=[RulePredictor()]))


async def test_cached_session_and_workspace_executor_are_executors() -> None:
    from bunshin_async.speculation import Executor

    async with ToolCache() as cache, Workspace() as ws, cache.session(ws, TOOLS) as session:
        assert isinstance(session, CachedSession) and isinstance(session, Executor)
        assert isinstance(WorkspaceExecutor(ws, TOOLS), Executor)
