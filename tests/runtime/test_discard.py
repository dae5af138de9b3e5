"""Discarding a speculative branch (``BranchSet.discard``, and the branches kept past a rollout's last turn when its
``background()`` ends): a branch in a fork of its own marks that fork's calls abandoned (its cancelled call returns
without waiting for the agent to reap the command: the fork is closed when the branch settles,
tests/workspace/test_lifecycle.py shows the wait cut), and so do the forks chained after it; a read run in place, in
a workspace that lives on, keeps the wait. The runtime's own logic, without starting a workspace."""

from __future__ import annotations

import time

import pytest

from bunshin_async import Workspace
from bunshin_async._runtime import _branches
from bunshin_async._runtime._branches import Branch, BranchSet
from bunshin_async._runtime._metrics import TurnLog
from bunshin_async.speculation import CallKey, Candidate, Launch, PredictionContext, TurnMetrics, WorkspaceHandle
from bunshin_async.tools import Effect, bash_tool

pytestmark = pytest.mark.unit


def _branch(owner: BranchSet, command: str, effect: Effect, ws: Workspace, parent: Branch | None = None) -> Branch:
    key = CallKey.of(bash_tool(), {"command": command})
    launch = Launch(candidate=Candidate(name="bash", arguments={}, probability=0.5), key=key, effect=effect)
    ctx = PredictionContext(history=(), chain=b"", turn=0, position=0)
    b = Branch(launch, 0, 0, 0.0, owner=owner, ctx=ctx, parent=parent)
    b.ws = ws
    if parent is not None:
        parent.children.append(b)
    return b


async def test_a_discarded_forks_calls_are_abandoned_and_an_in_place_reads_are_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    abandoned: list[Workspace] = []
    monkeypatch.setattr(_branches, "abandon_calls", abandoned.append)
    rollout, fork, chained = Workspace(), Workspace(), Workspace()  # never started: only their identity counts
    log = TurnLog(TurnMetrics(turn=0), time.monotonic)
    branches = BranchSet(WorkspaceHandle(rollout), {}, None, log)
    write = _branch(branches, "make", Effect.WRITE, fork)
    after = _branch(branches, "make test", Effect.WRITE, chained, parent=write)
    read_after = _branch(branches, "cat out", Effect.READ, fork, parent=write)  # in its parent's fork: not its own
    read = _branch(branches, "ls", Effect.READ, rollout)
    branches.discard(write)
    branches.discard(read)
    assert all(b.discarded for b in (write, after, read_after, read))
    assert abandoned == [fork, chained]


async def test_the_branches_kept_when_the_background_ends_are_abandoned_too(monkeypatch: pytest.MonkeyPatch) -> None:
    abandoned: list[Workspace] = []
    monkeypatch.setattr(_branches, "abandon_calls", abandoned.append)
    rollout, fork = Workspace(), Workspace()
    handle = WorkspaceHandle(rollout)
    branches = BranchSet(handle, {}, None, TurnLog(TurnMetrics(turn=0), time.monotonic))
    write, read = _branch(branches, "make", Effect.WRITE, fork), _branch(branches, "ls", Effect.READ, rollout)
    async with handle.background():
        handle.kept = [write, read]  # what the last turn handed on
    assert abandoned == [fork] and handle.kept == []
    assert write.scope.cancel_called and read.scope.cancel_called
