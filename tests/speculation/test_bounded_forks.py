"""``BoundedPolicy``'s fork budget counts the forks a finished turn still closes (``run_agent`` runs the turns in
``handle.background()``: a turn's unused forks settle in the handle's task group while the next turn selects). A
wasted branch's fork is held while it is measured (``fork_cost``, held at a gate) until the next turn's policy has
chosen: with ``max_forks=1`` that turn launches no second fork while the first still exists."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from bunshin_async import Workspace
from bunshin_async._runtime import _branches
from bunshin_async.speculation import BoundedPolicy, CallKey, Candidate, Launch, PredictionContext, Speculation
from bunshin_async.tools import bash_tool

from .agent_loop import agent_rollout
from .conftest import bash, final, trajectory


class _Elsewhere:
    """Predicts, before each call, a write the model never asks for (a new one each time): a fork, then wasted."""

    name = "elsewhere"

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        k = len(ctx.history) + ctx.position
        return [Candidate(name="bash", arguments={"command": f"echo {k} > /workspace/p{k}"}, probability=0.9,
                          source=self.name)]  # fmt: skip

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass


class _Closing:
    """Holds the first wasted fork's measurement (so the fork is not closed, not released) until the policy has
    chosen once more; records what it chose then."""

    def __init__(self) -> None:
        self.held = threading.Event()  # a fork is being settled, held
        self.gate = threading.Event()
        self.chosen_meanwhile: list[list[Launch]] | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = _branches.fork_cost

        def fork_cost(ws: Workspace, ready_peak: int | None = None) -> tuple[float, int]:
            if not self.gate.is_set():
                self.held.set()
                assert self.gate.wait(60)
            return real(ws, ready_peak)

        monkeypatch.setattr(_branches, "fork_cost", fork_cost)


class _Policy(BoundedPolicy):
    def __init__(self, closing: _Closing) -> None:
        super().__init__(max_branches=2, max_forks=1)
        self.closing = closing

    def select(self, options: Sequence[Launch], *, running: int, forks: int) -> list[Launch]:
        chosen = super().select(options, running=running, forks=forks)
        if self.closing.held.is_set() and not self.closing.gate.is_set():
            self.closing.chosen_meanwhile = [chosen]
            self.closing.gate.set()
        return chosen


async def test_a_turn_launches_no_fork_while_the_last_turns_fork_still_closes(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    closing = _Closing()
    closing.install(monkeypatch)
    policy = _Policy(closing)
    spec = Speculation(predictors=[_Elsewhere()], policy=policy, on_observation=False)
    steps = [bash("echo a > a", llm=0.05), bash("echo b > b", llm=0.3), bash("echo c > c", llm=0.3), final()]
    async with serve([trajectory("closing", steps)]) as client:
        async with Workspace() as ws:
            with anyio.fail_after(120):
                run = await agent_rollout(client, "replay:closing", ws, [bash_tool()], spec, early=False)
    assert [c.outcome for c in run.calls] == ["exit code 0\n"] * 3
    assert closing.chosen_meanwhile is not None, "no turn chose while a fork was closing"
    [chosen] = closing.chosen_meanwhile
    assert [o for o in chosen if o.needs_fork] == []  # the closing fork is the rollout's one
    assert spec.metrics.launched >= 2 and spec.metrics.committed == 0
    assert policy.live.total() == 0  # every fork released
