"""Acceptance tests of the turn runtime on real workspaces and scripted streams from the replay server."""

from __future__ import annotations

import gc
import shlex
import warnings
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import pytest

from bunshin_async import Workspace
from bunshin_async._llm._openai import tap_openai_stream
from bunshin_async._rollout._state import workspace_state
from bunshin_async._runtime._probes import fork_cost, upper_bytes
from bunshin_async._workspace._accounting import tree_bytes, workspace_memory
from bunshin_async.llm import FixedTiming, MessageFinished, TapEvent
from bunshin_async.speculation import (
    CallKey,
    CallResult,
    Candidate,
    Launch,
    PredictionContext,
    Speculation,
    SpeculativeTurn,
    WorkspaceHandle,
    run_turn,
)
from bunshin_async.tools import Effect, bash_tool, read_file_tool
from speculator import CostAwarePolicy, Rule, RulePredictor
from tests._walks import Walks
from tests.workspace.test_accounting import MANY_FILES

from .agent_loop import agent_rollout, held_client, off_and_on
from .conftest import bash, final, trajectory

TOOLS = [bash_tool(), read_file_tool()]
SLOW = "sleep 1; echo x > f"


def rules(*rs: Rule) -> Speculation:
    return Speculation(
        predictors=[RulePredictor(rs)], policy=CostAwarePolicy(contention=None, loop_load=None, memory_weight=0.0)
    )


async def test_correct_prediction_of_slow_write_commits_the_fork(serve: Any) -> None:
    """The slow call, predicted, runs in a fork while the model generates and the fork is committed. The model's
    message is held until the branch's call has started (``held_client``): a fork takes longer than the turn's 1.2 s on
    a loaded machine, and then the main line waits for the branch (a negative saving) without anything wrong."""
    steps = [bash("echo a > start", llm=0.05), bash(SLOW, llm=1.2), bash("cat f", llm=0.05), final()]
    rule = Rule(after="start", then_tool="bash", then_args={"command": SLOW}, probability=0.9, expected_seconds=1.0)
    started = anyio.Event()
    bash_ = bash_tool()
    assert bash_.handler is not None
    run_bash = bash_.handler

    async def handler(ws: Workspace, args: Any) -> Any:
        if args["command"] == SLOW:  # before the message ends only a branch can run it
            started.set()
        return await run_bash(ws, args)

    tools = [msgspec.structs.replace(bash_, handler=handler), read_file_tool()]
    async with serve([trajectory("slow", steps)]) as client:
        async with Workspace() as ws0:
            off = await agent_rollout(client, "replay:slow", ws0, TOOLS, None)
        gated = held_client(client, 2, started)  # the second request: the slow call's turn
        try:
            async with Workspace() as ws1:
                on = await agent_rollout(gated, "replay:slow", ws1, tools, rules(rule))
                assert on.moved  # the rollout moved into the committed fork
        finally:
            await gated.close()
    assert on.calls == off.calls and on.final_state == off.final_state
    assert on.calls[2].outcome == "exit code 0\nx\n"
    assert on.metrics.committed == 1 and on.metrics.wasted == 0
    slow_turn = on.turns[1]
    assert slow_turn.branches[0].outcome == "committed" and slow_turn.branches[0].effect == "write"
    # its run started before the call was due, so it is credited with a saving (how much it saves on this machine
    # is bench/'s to measure)
    assert slow_turn.saved_seconds > 0
    t = {e.kind: e.t for e in slow_turn.timeline}
    # launched in this turn, or (on the previous turn's last observation) in that one and adopted by this one
    started_at = t["branch_launch"] if "branch_launch" in t else t["branch_kept"]
    assert started_at < t["message_finished"] < t["branch_commit"], slow_turn.timeline


async def test_a_fork_is_weighed_before_its_call_runs(serve: Any) -> None:
    """What a fork and its rollout hold is read when the fork is ready and before its call starts: read beside the
    call, the call's own processes (a shell and what it runs: 0.5 MiB for a ``sleep``) were counted as the fork's,
    though a hit's call holds them on the main line alike; the launch rule then found a fork of a small workspace
    several times its rollout's size (issue 38)."""
    order: list[str] = []

    class Spy(CostAwarePolicy):
        def observe_copy(self, copy_bytes: int, rollout_bytes: int, rollout: str = "") -> None:
            order.append("weighed")
            super().observe_copy(copy_bytes, rollout_bytes, rollout)

    bash_ = bash_tool()
    assert bash_.handler is not None
    run_bash = bash_.handler

    async def handler(ws: Workspace, args: Any) -> Any:
        order.append(args["command"])
        return await run_bash(ws, args)

    tools = [msgspec.structs.replace(bash_, handler=handler), read_file_tool()]
    steps = [bash("echo a > start", llm=0.05), bash(SLOW, llm=1.2), final()]
    rule = Rule(after="start", then_tool="bash", then_args={"command": SLOW}, probability=0.9, expected_seconds=1.0)
    policy = Spy(contention=None, loop_load=None, memory_weight=0.0)
    async with serve([trajectory("weighed", steps)]) as client, Workspace() as ws:
        on = await agent_rollout(client, "replay:weighed", ws, tools, Speculation([RulePredictor([rule])], policy))
    assert on.metrics.committed == 1
    assert order == ["echo a > start", "weighed", SLOW], order  # the branch's call ran in the fork, after
    assert policy.copy_extra.n == 1 and policy.fork_bytes.n >= 1


async def test_a_forks_making_and_its_call_are_measured_as_the_kernel_charges_them(serve: Any) -> None:
    """Beside the fork's own bytes the policy is told what its making held (``observe_transient``: the fork's cgroup
    peak before its call less its charge then, CRIU's restore) and, once the call ended, what the call held in the fork
    (``observe_fork_call``: the cgroup's peak above that): a hit's call was taken to hold on the main line what it
    holds in the fork, and on the long-tool groups it did not (session 19). ``dd`` with a 32 MiB block touches
    a 32 MiB buffer: the call is measured at least 24 MiB (its peak above the making's, which held CRIU's restore,
    a few MiB: with a 16 MiB buffer and a 16 MiB bound it once measured 15.8), the run time with it, and the
    byte-seconds it held over its run."""
    mib = 1 << 20
    seen: dict[str, list[Any]] = {"transient": [], "call": []}

    class Spy(CostAwarePolicy):
        def observe_transient(self, memory_bytes: int) -> None:
            seen["transient"].append(memory_bytes)
            super().observe_transient(memory_bytes)

        def observe_fork_call(self, key: CallKey, seconds: float, memory_bytes: int, byte_seconds: float) -> None:
            seen["call"].append((key.arguments()["command"], seconds, memory_bytes, byte_seconds))
            super().observe_fork_call(key, seconds, memory_bytes, byte_seconds)

    dd = "dd if=/dev/zero of=/dev/null bs=32M count=1 2>/dev/null; sleep 0.3; echo x > f"
    steps = [bash("echo a > start", llm=0.05), bash(dd, llm=1.2), final()]
    rule = Rule(after="start", then_tool="bash", then_args={"command": dd}, probability=0.9, expected_seconds=1.0)
    policy = Spy(contention=None, loop_load=None, memory_weight=0.0)
    async with serve([trajectory("measured", steps)]) as client, Workspace() as ws:
        on = await agent_rollout(client, "replay:measured", ws, TOOLS, Speculation([RulePredictor([rule])], policy))
    assert on.metrics.committed == 1
    assert len(seen["transient"]) == 1 and seen["transient"][0] > 1 * mib  # CRIU's restore at least
    [(command, seconds, held, byte_seconds)] = seen["call"]
    assert command == dd and seconds >= 0.3 and held >= 24 * mib
    assert 0 <= byte_seconds <= held * seconds  # what it held over its run (``CallMeter``), at most its peak
    assert policy.calls.measured and policy.memory.transient_bytes.value == seen["transient"][0]


async def test_wrong_prediction_leaves_no_trace(serve: Any) -> None:
    wrong = "sleep 0.3; echo wrong > w; touch /tmp/wrong; (sleep 30 &) ; sleep 30"
    steps = [bash("echo a > start", llm=0.05), bash("echo right > r", llm=0.8), final()]
    rule = Rule(after="start", then_tool="bash", then_args={"command": wrong}, probability=0.9, expected_seconds=1.0)
    async with serve([trajectory("wrong", steps)]) as client:
        async with Workspace() as ws0:
            off = await agent_rollout(client, "replay:wrong", ws0, TOOLS, None)
        async with Workspace() as ws1:
            on = await agent_rollout(client, "replay:wrong", ws1, TOOLS, rules(rule))
            assert not on.moved
            probe = await ws1.exec("ls /workspace; ls /tmp; ps -eo args=")
    assert on.calls == off.calls and on.final_state == off.final_state
    assert "wrong" not in probe.stdout and "sleep" not in probe.stdout
    turn = on.turns[1]
    [branch] = turn.branches
    assert branch.outcome == "wasted" and branch.effect == "write"
    assert turn.wasted == 1 and turn.wasted_memory_bytes > 0
    # the turn did not wait for it: the branch (30 s) was discarded while it still ran
    assert "branch_done" not in [e.kind for e in turn.timeline], turn.timeline


class _AlwaysWrong:
    """Guesses, before every call, a slow write the model never asks for."""

    name = "always-wrong"

    def predict(self, ctx: PredictionContext) -> list[Candidate]:
        command = "sleep 2; touch /workspace/never"
        return [Candidate(name="bash", arguments={"command": command}, probability=0.9, source=self.name,
                          expected_seconds=2.0)]  # fmt: skip

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass


async def test_a_predictor_that_is_never_right_stops_being_launched(serve: Any) -> None:
    steps = [bash(f"echo {i} > f{i}", llm=0.1) for i in range(24)] + [final()]
    policy = CostAwarePolicy(contention=None, loop_load=None, memory_weight=0.0)
    spec = Speculation(predictors=[_AlwaysWrong()], policy=policy)
    async with serve([trajectory("never", steps)]) as client:
        off, on = await off_and_on(client, "replay:never", TOOLS, spec)
    launched = [len(t.branches) for t in on.turns]
    assert launched[0] == 1 and on.metrics.committed == 0, launched
    # every decided call scored the guess (launched or not); its odds fell until the fork no longer paid: the
    # later turns launched nothing (at 0.9 and the runtime's default costs they would all have launched)
    assert policy.calibration("always-wrong") < 0.2
    assert sum(launched[-5:]) == 0, (launched, policy.calibration("always-wrong"))
    # each discarded fork's memory was measured on its cgroup, its call's included (what a miss holds), and the
    # rollout's footprint; and, before each fork's call, the fork's and its rollout's (what a fork holds, used or not)
    miss = policy.memory.miss_bytes
    assert miss is not None and miss.n >= 1 and policy.fork_bytes.n >= 1 and policy.rollout_bytes.n >= sum(launched)
    assert miss.value > 0 and policy.fork_bytes.value > 0 and policy.rollout_bytes.value > 0


class _Counting(_AlwaysWrong):
    """``_AlwaysWrong``, counting how often it is asked."""

    name = "counting"

    def __init__(self) -> None:
        self.asked = 0

    def predict(self, ctx: PredictionContext) -> list[Candidate]:
        self.asked += 1
        return super().predict(ctx)


async def test_a_saturated_event_loop_pauses_speculation(serve: Any) -> None:
    """While the event loop's thread is saturated (``loop_load`` at ``max_loop_load`` or more: every rollout waits on
    it, so a hidden tool call only adds to its work) the policy is not active: no predictor is asked, nothing is
    launched, each skipped decision point is counted; with room on the loop again the same policy speculates."""
    steps = [bash(f"echo {i} > f{i}", llm=0.1) for i in range(4)] + [final()]
    load = [1.0]
    policy = CostAwarePolicy(contention=None, loop_load=lambda: load[0], max_loop_load=0.8, memory_weight=0.0)
    busy, idle = _Counting(), _Counting()
    async with serve([trajectory("busy", steps)]) as client:
        off, on = await off_and_on(client, "replay:busy", TOOLS, Speculation(predictors=[busy], policy=policy))
        load[0] = 0.5
        _, later = await off_and_on(client, "replay:busy", TOOLS, Speculation(predictors=[idle], policy=policy))
    assert on.calls == off.calls and on.final_state == off.final_state
    assert busy.asked == 0 and on.metrics.launched == 0
    assert on.metrics.paused >= len(steps) - 1  # at least once per turn with a call
    assert idle.asked > 0 and later.metrics.launched > 0 and later.metrics.paused == 0


async def test_the_policy_learns_which_calls_compute_and_which_wait(serve: Any) -> None:
    """Each call run on the main line is timed on its workspace's cgroup CPU: a loop that computes takes up to a
    CPU second per second, a sleep almost none (what the contention term charges a wrong guess with)."""
    spin = "python3 -c 'import time; t = time.process_time(); exec(\"while time.process_time() - t < 0.5: pass\")'"
    steps = [bash(spin, llm=0.05), bash("sleep 0.5", llm=0.05), final()]
    policy = CostAwarePolicy(contention=None, loop_load=None)
    spec = Speculation(predictors=[], policy=policy)
    async with serve([trajectory("cpu", steps)]) as client, Workspace() as ws:
        await agent_rollout(client, "replay:cpu", ws, TOOLS, spec)

    def share(command: str) -> float:
        key = CallKey.of(bash_tool(), {"command": command})
        return policy.cpu_share(
            Launch(candidate=Candidate(name="bash", arguments={}, probability=1.0), key=key, effect=Effect.WRITE)
        )

    # an order, not a figure: how much of a CPU the loop got depends on what else this machine runs
    assert share(spin) > share("sleep 0.5") and share("sleep 0.5") < 0.2, (share(spin), share("sleep 0.5"))


async def test_a_restored_copys_footprint_counts_the_page_image_it_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollout that is a copy-on-write copy maps its snapshot's page image, which its cgroup is not charged for: its
    footprint (what a fork's memory is weighed against) counts it, so a fork is not judged many times its size; and
    so does a fork's own cost (``fork_cost``), so a fork is not judged a tenth of what it holds. Neither walks the
    copy's tree: what it wrote is its tmpfs's count (``upper_bytes``), the walk's bytes."""
    hold = "import os, time; x = os.urandom(48 << 20); open('/workspace/ready', 'w').close(); time.sleep(1e6)"
    async with Workspace() as ws:
        await ws.spawn(["python3", "-c", hold])
        with anyio.fail_after(60):
            while (await ws.exec("test -e /workspace/ready")).exit_code:  # noqa: ASYNC110 - polls the guest
                await anyio.sleep(0.05)
        [copy] = await ws.fork(1)
        try:
            footprint = await anyio.to_thread.run_sync(workspace_memory, copy)
            assert footprint >= 48 << 20, footprint
            _cpu, cost = await anyio.to_thread.run_sync(fork_cost, copy)  # what a branch's fork is charged
            assert cost >= 48 << 20, cost
            assert copy.cgroup is not None
            peak = copy.cgroup.memory_peak() or 0
            if copy.fork_mode == "criu-cow":  # the image is charged to no copy: the cgroup alone would say ~nothing
                assert peak < footprint / 2, (peak, footprint)
            assert (await copy.exec(f"python3 -c {shlex.quote(MANY_FILES)}")).exit_code == 0
            walks = Walks().install(monkeypatch)
            _cpu, cost = await anyio.to_thread.run_sync(fork_cost, copy)
            written = await anyio.to_thread.run_sync(upper_bytes, copy)
            assert walks.roots == []  # neither walked the copy's 3000 files
            walked = await anyio.to_thread.run_sync(tree_bytes, copy.directory / "upper")
            assert written == walked and written > 6 << 20, (written, walked)
            assert cost >= (48 << 20) + written, cost  # the image it maps and what it wrote
        finally:
            await copy.aclose()


async def _tap(client: Any, model: str, messages: list[dict[str, Any]]) -> Any:
    """The tap (an async context manager) over a streamed completion of ``messages`` with ``TOOLS``."""
    specs = [t.spec() for t in TOOLS]
    stream = await client.chat.completions.create(model=model, messages=messages, tools=specs, stream=True)
    return tap_openai_stream(stream, specs)


async def test_cancelling_the_turn_cancels_every_branch(serve: Any) -> None:
    steps = [bash("echo a > start", llm=0.05), bash("echo never > n", llm=5.0), final()]
    rs = [
        Rule(after="start", then_tool="bash", then_args={"command": "sleep 20; echo w > w"}, expected_seconds=20),
        Rule(after="start", then_tool="bash", then_args={"command": "sleep 20; cat start"}, expected_seconds=20),
    ]
    spec = Speculation(
        predictors=[RulePredictor(rs)], policy=CostAwarePolicy(contention=None, loop_load=None, memory_weight=0.0)
    )
    async with serve([trajectory("cancel", steps)]) as client:
        async with Workspace() as ws, WorkspaceHandle(ws) as handle:
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "x"}]
            async with await _tap(client, "replay:cancel", msgs) as tap:
                first = await run_turn(tap, handle, TOOLS, spec)
            msgs += [
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function",
                 "function": {"name": "bash", "arguments": first.message.tool_calls[0].raw}}]},
                {"role": "tool", "tool_call_id": "c0", "content": "ok"},
            ]  # fmt: skip
            # cancelled once both branches run (their 20 s sleeps): it returns without waiting for them
            with anyio.fail_after(15), anyio.CancelScope() as scope:
                tapped = await _tap(client, "replay:cancel", msgs)
                async with tapped as tap, SpeculativeTurn(handle, TOOLS, spec) as turn:
                    async for _ in turn.feed(tap):
                        kinds = [e.kind for e in turn.metrics.timeline]
                        if kinds.count("branch_launch") == 2 and "branch_ready" in kinds:  # the write's fork runs
                            scope.cancel()
            assert scope.cancelled_caught
            assert {b.outcome for b in turn.metrics.branches} == {"wasted"} and len(turn.metrics.branches) == 2
            assert handle.workspace is ws
            probe = await ws.exec(["ps", "-eo", "args="])
            assert "sleep" not in probe.stdout  # the in-place read branch was killed with its process group
            assert (await ws.exec("ls /workspace")).stdout == "start\n"  # the write branch's fork is gone
    # the leak fixtures check that no fork, snapshot or process is left


async def test_run_turn_reports_each_result_as_soon_as_it_is_ready(serve: Any) -> None:
    """``run_turn(on_result=...)``, the agent loop's path (the turn consumes the stream in place, relaying no
    event), still hands each result over when it is ready, not when the message's last call is done."""
    # the second call ends only once the first one's result was handed over (reported at the end, it never would)
    slow = "for i in $(seq 600); do [ -e /workspace/go ] && break; sleep 0.05; done; echo slow"
    steps = [bash("echo fast", turn=0), bash(slow, turn=0), final()]
    seen: list[str] = []
    first = anyio.Event()

    def on_result(r: CallResult) -> None:
        seen.append(r.result.stdout)
        first.set()

    async with serve([trajectory("each", steps)]) as client:
        async with Workspace() as ws, WorkspaceHandle(ws) as handle, anyio.create_task_group() as tg:

            async def go() -> None:
                await first.wait()
                await ws.exec("touch /workspace/go")

            tg.start_soon(go)
            async with await _tap(client, "replay:each", [{"role": "user", "content": "x"}]) as tap:
                with anyio.fail_after(60):
                    outcome = await run_turn(tap, handle, TOOLS, None, on_result=on_result)
    assert seen == ["fast\n", "slow\n"]
    assert [r.result.stdout for r in outcome.results] == ["fast\n", "slow\n"]


async def test_a_turn_cancelled_before_its_stream_is_read_closes_its_streams() -> None:
    async def never() -> AsyncIterator[TapEvent]:
        await anyio.sleep_forever()
        yield MessageFinished(content="", tool_calls=[], finish_reason="stop", t=0.0)  # pragma: no cover

    async with Workspace() as ws, WorkspaceHandle(ws) as handle:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with anyio.CancelScope() as scope:
                async with SpeculativeTurn(handle, TOOLS, rules()) as turn:
                    relay = turn.feed(never())  # neither the pump nor the relay has started
                    scope.cancel()
                    await anyio.sleep(1)
            del relay, turn
            gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


async def test_two_parallel_calls_in_one_message(serve: Any) -> None:
    steps = [
        bash("sleep 0.4; echo a > a", llm=0.3, turn=0),
        bash("sleep 0.4; cat a; echo b > b", llm=0.0, turn=0),
        bash("cat a b", llm=0.05, turn=1),
        bash("timeout 0.3 tail -f a; ls", llm=0.0, turn=1),  # reads (by the classifier) that take 0.3 s
        bash("timeout 0.3 tail -f b; wc -c a", llm=0.0, turn=1),
        final(),
    ]
    rule = Rule(at_start=True, then_tool="bash", then_args={"command": "sleep 0.4; echo a > a"}, probability=0.9,
                expected_seconds=0.4)  # fmt: skip
    async with serve([trajectory("par", steps)]) as client:
        off, on = await off_and_on(client, "replay:par", TOOLS, rules(rule))
    assert [c.outcome for c in on.calls[:3]] == ["exit code 0\n", "exit code 0\na\n", "exit code 0\na\nb\n"]
    assert on.turns[0].committed == 1 and on.turns[0].calls == 2
    # the two reads of turn 1 ran concurrently: both started before either was done
    reads = on.turns[1]
    starts = [e.t for e in reads.timeline if e.kind == "call_start"]
    dones = [e.t for e in reads.timeline if e.kind == "call_done"]
    assert len(starts) == len(dones) == 3 and sorted(starts)[-1] < sorted(dones)[1], reads.timeline


async def test_results_arrive_before_the_message_ends(serve: Any) -> None:
    steps = [
        bash("sleep 0.2; echo one > one", llm=0.1, turn=0),
        bash("echo two > two", llm=0.0, turn=0, text=""),
        final(),
    ]
    traj = trajectory("early", steps)
    async with serve([traj], timing=FixedTiming(ttft=0.01, itl=0.05)) as client:
        async with Workspace() as ws, WorkspaceHandle(ws) as handle:
            tapped = await _tap(client, "replay:early", [{"role": "user", "content": "x"}])
            seen: list[str] = []
            async with tapped as tap, SpeculativeTurn(handle, TOOLS, Speculation()) as turn:
                async for item in turn.feed(tap):
                    if isinstance(item, CallResult):
                        seen.append(f"result{item.index}")
                    elif isinstance(item, MessageFinished):
                        seen.append("finished")
                outcome = await turn.results()
            assert seen.index("result0") < seen.index("finished")
            assert [r.result.exit_code for r in outcome.results] == [0, 0]
            assert "one" in await workspace_state(handle.workspace)


@pytest.mark.parametrize("spec_on", [False, True])
async def test_tool_errors_are_results(serve: Any, spec_on: bool) -> None:
    from bunshin_async.rollout import Step

    steps = [Step("read_file", {"path": "missing.txt"}, llm_seconds=0.03), final()]
    async with serve([trajectory("err", steps)]) as client:
        async with Workspace() as ws:
            rs = Rule(at_start=True, then_tool="read_file", then_args={"path": "missing.txt"}, expected_seconds=1)
            out = await agent_rollout(client, "replay:err", ws, TOOLS, rules(rs) if spec_on else None)
    assert out.calls[0].outcome == "error: no such file or directory: 'missing.txt'"
    assert out.metrics.committed == (1 if spec_on else 0)


@pytest.mark.unit
def test_bunshin_async_does_not_import_speculator() -> None:
    import subprocess
    import sys

    code = "import sys, bunshin_async.speculation, bunshin_async.agent; print('speculator' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
