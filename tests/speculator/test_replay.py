"""The runtime's launch decision replayed offline: what the policy launches of the predictions, which rule refuses
the rest, and what the launches hide, on small made-up traces."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

import speculator._replay as replay_module
from bunshin_async._runtime import _branches, _mainline
from bunshin_async.speculation import CallKey, Candidate, Launch, PredictionContext, Predictor, tell_run
from bunshin_async.tools import Effect, bash_tool
from speculator import CostAwarePolicy
from speculator._replay import REASONS, ByteModel, explain, replay

pytestmark = pytest.mark.unit

BASH = bash_tool()


def _record(*steps: tuple[str, float, float]) -> dict[str, Any]:
    return {"steps": [{"tool": "bash", "args": {"command": c}, "llm_seconds": llm, "tool_seconds": tool}
                      for c, llm, tool in steps]}  # fmt: skip


class _Script:
    """Guesses, at call ``i`` of its rollout, ``guesses[i]``: (command, probability, stated run time or None)."""

    name = "script"

    def __init__(self, guesses: Sequence[Sequence[tuple[str, float, float | None]]]) -> None:
        self.guesses = guesses

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        i = len(ctx.history)
        return [
            Candidate(name="bash", arguments={"command": c}, probability=p, source=self.name, expected_seconds=s)
            for c, p, s in (self.guesses[i] if i < len(self.guesses) else ())
        ]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        pass


def _make(*per_rollout: Sequence[Sequence[tuple[str, float, float | None]]]) -> Callable[[str], Any]:
    def make(task: str) -> Callable[[], Sequence[Predictor]]:
        scripts = iter(per_rollout)
        return lambda: [_Script(next(scripts))]

    return make


def test_a_long_call_is_launched_in_a_fork_only_when_the_policy_knows_it_is_long() -> None:
    group = {"t": [_record(("ls", 1.0, 0.1), ("pip install x", 5.0, 20.0))]}
    told = replay(group, _make([[], [("pip install x", 1.0, 20.0)]])).total()
    assert (told["launched"], told["forks"], told["hits"]) == (1, 1, 1)
    # a fork is asked for at the turn's end: it hid the LLM time less the fork's own
    assert told["hidden"] == pytest.approx(5.0 - ByteModel().fork_seconds)
    # the same right guess without a run time: the policy takes the call for a short one, whose fork cannot pay
    # for the memory it holds until the ask (where a copy holds as much as its rollout: a first copy that holds
    # less saves that to the rollout's end, which pays for a fork whatever it hides)
    blind = replay(group, _make([[], [("pip install x", 1.0, None)]]), model=ByteModel(copy_extra_mib=0.0)).total()
    assert blind.get("launched", 0) == 0 and blind["GiB·s"] == 1 and blind["right GiB·s"] == 1
    assert blind["right GiB·s s"] == pytest.approx(5.0)  # the hideable seconds that rule gave up


def test_every_offer_is_launched_or_refused_by_one_rule() -> None:
    group = {
        "t": [
            _record(("ls", 1.0, 0.1), ("pip install x", 5.0, 20.0), ("python3 a.py", 3.0, 2.0)),
            _record(("ls", 2.0, 0.1), ("pip install y", 5.0, 20.0)),
        ]
    }
    guesses = [
        [("ls", 0.9, None), ("rm -rf /tmp/x", 0.01, None)],
        [("pip install x", 0.9, 20.0), ("pip install y", 0.3, 20.0), ("curl http://x", 0.9, None)],
        [("python3 a.py", 0.4, None), ("python3 b.py", 0.4, None)],
    ]
    report = replay(group, _make(guesses, guesses))
    for task in report.by_task:
        for row in report.by_task[task].values():
            refused = sum(row.get(r, 0.0) for r in REASONS)
            assert row.get("offered", 0.0) == row.get("launched", 0.0) + refused
    total = report.total()
    assert total["unspeculable"] == 2  # curl reaches outside the workspace: never speculated
    assert total["odds"] >= 2  # 0.01 is under the policy's floor
    assert total.get("unexplained", 0) == 0  # the replay of select's rules agrees with select
    # the wrong guesses that ran are counted (what ``pip install y`` ran in rollout 0 until the ask, if launched)
    assert total["hits"] >= 2 and total["hidden"] > 0


def test_a_siblings_call_is_served_by_the_cache_only_once_it_ended() -> None:
    # rollout 1 asks for ``pip install x`` at 7.1 s; rollout 0 decided it at 6.1 s and runs it until 26.1 s
    running = {"t": [_record(("ls", 1.0, 0.1), ("pip install x", 5.0, 20.0)),
                     _record(("ls", 2.0, 0.1), ("pip install x", 5.0, 20.0))]}  # fmt: skip
    guess = [[], [("pip install x", 1.0, 20.0)]]
    total = replay(running, _make(guess, guess)).total()
    assert total["hits"] == 2 and total.get("cached", 0) == 0
    # rollout 1 starts the turn at 30 s: rollout 0's install ended at 26.1 s, its result is the cache's
    ended = {"t": [_record(("ls", 1.0, 0.1), ("pip install x", 5.0, 20.0)),
                   _record(("ls", 30.0, 0.1), ("pip install x", 5.0, 20.0))]}  # fmt: skip
    total = replay(ended, _make(guess, guess)).total()
    assert total["hits"] == 1 and total["cached"] == 1 and total["right cached"] == 1


def _launch(command: str, p: float, rollout: str = "r") -> Launch:
    key = CallKey.of(BASH, {"command": command})
    effect = BASH.classify_call(key.arguments()).effect
    cand = Candidate(name="bash", arguments=key.arguments(), probability=p, source="s", expected_seconds=20.0)
    return Launch(candidate=cand, key=key, effect=effect, rollout=rollout, group="g")


@pytest.mark.parametrize(("fork_mib", "verdict"), [(0.2, "launched"), (50.0, "GiB·s")])
def test_explain_names_the_rule_select_applied(fork_mib: float, verdict: str) -> None:
    policy = ByteModel(fork_mib=fork_mib, rollout_mib=0.5).policy(lambda: 0.0)
    options = [_launch("cat a.txt", 0.9), _launch("pip install x", 0.9), _launch("pip install z", 0.01)]
    assert options[0].effect is not Effect.WRITE and options[1].needs_fork
    selected = policy.select(options, running=0, forks=0)
    assert explain(policy, options, selected, running=0, forks=0) == ["launched", verdict, "odds"]
    # what select did not do is not passed off as a rule's verdict
    fresh = CostAwarePolicy(contention=None, loop_load=None)
    assert explain(fresh, options[:1], [], running=0, forks=0) == ["unexplained"]


def test_the_replay_feeds_the_memory_terms_the_runtime_measures() -> None:
    """The replay tells the policy what the runtime measures of each fork (``ByteModel``: its making, its call's
    bytes by program, a miss's bytes), so its refusals are the runtime's (session 19's decision logs): a wrong
    guess of an install held an install's memory until the ask, and a later right guess of a call whose signature
    no fork has run is charged a miss's call as big; where installs hold nothing, it is launched."""
    group = {"t": [_record(("ls", 1.0, 0.1), ("make a", 3.0, 9.0), ("make b", 3.0, 9.0), ("make c", 3.0, 9.0))]}
    wrong = [[], [("pip install y", 0.9, 9.0)], [("pip install z", 0.9, 9.0)], [("make c", 0.9, 9.0)]]
    assert ByteModel().call_mib(CallKey.of(BASH, {"command": "cd /a && pip3 install x"})) == 40.0
    assert ByteModel().call_mib(CallKey.of(BASH, {"command": "python3 a.py"})) == 3.0
    assert ByteModel().call_mib(CallKey.of(BASH, {"command": "make"})) == 0.0
    charged = replay(group, _make(wrong), model=ByteModel(memory_share=0.0))
    total = charged.total()
    assert (total["launched"], total.get("hits", 0), total["GiB·s"]) == (1, 0, 1)  # the first install's guess
    [refused] = charged.refused
    assert (refused.command, refused.reason) == ("make c", "GiB·s") and refused.memory_net is not None
    assert refused.memory_net < -40 * 2.0 * (1 - (refused.probability or 0))  # a miss's 40 MiB, 2 s at least
    free = replay(group, _make(wrong), model=ByteModel(install_mib=0.0, memory_share=0.0)).total()
    assert (free["launched"], free["hits"], free.get("GiB·s", 0)) == (2, 1, 0)


def test_each_rollouts_seconds_and_what_was_hidden_on_it() -> None:
    """Per rollout: its turns to their message's end (the tap's interval after the last token), its answer's
    turn, its calls but those the cache serves; a hit hides its lead, the tap starts every call its interval early
    (a hit's too, at most the call's run time)."""
    answer = {"tool": "submit", "args": {}, "llm_seconds": 2.0, "tool_seconds": 0.0}
    first = _record(("ls", 1.0, 0.1), ("pip install x", 5.0, 20.0))
    first["steps"].append(answer)
    second = _record(("ls", 3.0, 0.1), ("make", 1.0, 4.0))  # its ls is served by the cache (the first's ended)
    group = {"t": [first, second]}
    make = _make([[], [("pip install x", 1.0, 20.0)]], [])
    times = replay(group, make, tap=lambda call, llm: 0.5).rollouts["t"]
    fork = ByteModel().fork_seconds
    assert times[0].seconds == pytest.approx(1.0 + 0.1 + 5.0 + 20.0 + 2.0 + 2 * 0.5)
    assert times[0].hidden == pytest.approx(5.0 - fork)
    assert times[0].tapped == pytest.approx(0.1 + 5.0 - fork + 0.5)
    assert times[1].seconds == pytest.approx(3.0 + 1.0 + 4.0 + 2 * 0.5)  # no ls: the cache served it
    assert (times[1].hidden, times[1].tapped) == (0.0, 0.5)
    untapped = replay(group, make).rollouts["t"]
    assert untapped[0].seconds == pytest.approx(28.1) and untapped[0].tapped == untapped[0].hidden


def test_a_write_in_flight_on_a_siblings_main_line_is_served_by_its_flight() -> None:
    """The cache's single flight: an identical write a sibling's main line is running is not launched (the
    runtime's skip, ``ToolCache.would_hit``), and fork+cache's rollout waits for that flight, not its own run."""
    first = _record(("ls", 1.0, 0.1), ("pip install x", 1.0, 20.0))  # the install runs from 2.1 to 22.1
    second = _record(("ls", 3.0, 0.1), ("pip install x", 5.0, 30.0))  # its turn starts at 3.1, decided at 8.1
    report = replay({"t": [first, second]}, _make([], [[], [("pip install x", 1.0, 20.0)]]))
    seen = report.total()
    assert seen["right cached"] == 1 and seen.get("launched", 0) == 0
    assert report.rollouts["t"][1].seconds == pytest.approx(3.0 + 5.0 + 22.1 - 8.1)  # its ls served too
    assert report.hideable["t"] == pytest.approx(0.1 + 1.0)  # the first's ls and install alone


def test_the_replay_tells_the_policy_what_an_install_held_over_its_run_not_its_peak_for_all_of_it() -> None:
    """The runtime measures what a fork's call held over its run (``CallMeter``); the replay models it as the
    runtime would read a padded install: its bytes for ``install_seconds`` (session 19's ledger: 0.3-3.2 s), the
    rest of its recorded run a sleep. A later install's miss is then charged what the measured one held, not its
    peak for the whole hidden time: with an allowance that fits the one and not the other, the guess launches only
    when the replay tells the policy the byte-seconds (``install_seconds=inf``: the peak held throughout).

    An install runs on the main line first (``pip install c``, guessed by nobody): only there is the policy told a
    signature's run time and CPU (``tell_run``), as the runtime tells it. Without it every install ran in a fork:
    the policy never learns what CPU an install takes (one CPU a second, its prior) and the miss's CPU refuses the
    guess on latency before its memory is weighed."""
    assert ByteModel().call_byte_seconds(CallKey.of(BASH, {"command": "pip install a"}), 15.0) == 40 * 3.2 * 2**20
    assert ByteModel().call_byte_seconds(CallKey.of(BASH, {"command": "pip install a"}), 1.0) == 40 * 2**20
    assert ByteModel().call_byte_seconds(CallKey.of(BASH, {"command": "python3 a.py"}), 15.0) == 3 * 15 * 2**20
    assert ByteModel().call_byte_seconds(CallKey.of(BASH, {"command": "make"}), 15.0) == 0
    group = {"t": [_record(("ls", 8.0, 0.1), ("make", 8.0, 0.5), ("pip install c", 8.0, 15.0),
                           ("pip install a", 8.0, 15.0), ("pip install b", 8.0, 15.0))]}  # fmt: skip
    guesses = [[], [("make", 1.0, 0.5)], [], [("pip install a", 0.9, 15.0)], [("pip install b", 0.5, 15.0)]]
    measured = replay(group, _make(guesses), model=ByteModel(memory_share=5.0))
    peak = replay(group, _make(guesses), model=ByteModel(memory_share=5.0, install_seconds=float("inf")))
    assert (measured.total()["hits"], measured.refused) == (3, [])
    assert peak.total()["hits"] == 2
    [refused] = peak.refused
    assert (refused.command, refused.reason) == ("pip install b", "GiB·s")
    forks_only = {"t": [_record(("ls", 8.0, 0.1), ("make", 8.0, 0.5), ("pip install a", 8.0, 15.0),
                                ("pip install b", 8.0, 15.0))]}  # fmt: skip
    blind = replay(forks_only, _make(guesses[:2] + guesses[3:]), model=ByteModel(memory_share=5.0))
    [refused] = blind.refused
    assert (refused.command, refused.reason, blind.total()["hits"]) == ("pip install b", "latency", 2)


class _Telling(CostAwarePolicy):
    """What the runtime tells a policy of each run (``tell_run``), in order: ``(hook, command, seconds[, CPU])``."""

    told: list[tuple[str, str, float] | tuple[str, str, float, float]] = []

    def observe_tool(self, key: CallKey, seconds: float) -> None:
        self.told.append(("tool", key.arguments()["command"], round(seconds, 3)))
        super().observe_tool(key, seconds)

    def observe_cpu(self, key: CallKey, cpu_seconds: float, seconds: float) -> None:
        self.told.append(("cpu", key.arguments()["command"], round(seconds, 3), round(cpu_seconds, 3)))
        super().observe_cpu(key, cpu_seconds, seconds)

    def observe_fork_call(self, key: CallKey, seconds: float, memory_bytes: int, byte_seconds: float = -1.0) -> None:
        self.told.append(("fork", key.arguments()["command"], round(seconds, 3)))
        super().observe_fork_call(key, seconds, memory_bytes, byte_seconds)


def test_the_replay_tells_the_policy_of_each_run_what_the_runtime_tells_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime tells the policy of a main-line run its seconds and CPU, of a call the tool cache served the
    seconds of its restore (a read's stored result: none; a write in flight on a sibling: its wait, then the
    restore), of a read run in place its run, and of a fork's call only ``observe_fork_call``, hit or miss (cost21's
    finding: the replay told every call's recorded seconds as a main-line run). Both tell it through one function,
    ``tell_run``, which the runtime's main line and branches call too."""
    assert replay_module.tell_run is _mainline.tell_run is _branches.tell_run is tell_run
    monkeypatch.setattr(_Telling, "told", [])
    monkeypatch.setattr(replay_module, "CostAwarePolicy", _Telling)
    group = {
        "t": [
            # ls on the main line (1.0-1.1); the install in a fork (a hit at 6.1, ends at 26.1); cat in place (a hit)
            _record(("ls", 1.0, 0.1), ("pip install x", 5.0, 20.0), ("cat log", 4.0, 2.0)),
            # its ls the cache's (ended at 1.1); its install decided at 8.1, while the first's runs: waits 18 s
            _record(("ls", 3.0, 0.1), ("pip install x", 5.0, 20.0)),
            # its install decided at 32.1, after the first's ended: a restore
            _record(("ls", 2.0, 0.1), ("pip install x", 30.0, 20.0)),
        ]
    }
    guesses = [[], [("pip install x", 1.0, 20.0)], [("cat log", 1.0, 2.0)]]
    assert replay(group, _make(guesses, [], [])).total()["hits"] == 2
    restore = ByteModel().restore_seconds
    assert _Telling.told == [
        ("fork", "true", 0.0),  # the byte model's measured fork (``ByteModel.told``)
        ("tool", "ls", 0.1),
        ("cpu", "ls", 0.1, round(0.1 * ByteModel().cpu_share, 3)),
        ("tool", "ls", 0.0),  # the cache's stored result (rollout 2's turn ends first)
        ("tool", "ls", 0.0),
        ("fork", "pip install x", 20.0),  # the hit, as its branch settles: never a main-line run
        ("tool", "pip install x", round(18.0 + restore, 3)),  # the sibling's flight, then its restore
        ("tool", "cat log", 2.0),  # in place: its run, no CPU read
        ("tool", "pip install x", restore),
    ]


class _Told:
    """Guesses (p 1, 10 s) whatever a sibling decided and the rollout did not, from any state: the group's
    ``decided`` list."""

    name = "told"

    def __init__(self, decided: list[CallKey]) -> None:
        self.decided = decided

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        return [
            Candidate(name=k.name, arguments=k.arguments(), probability=1.0, source=self.name, expected_seconds=10.0)
            for k in self.decided
            if k not in ctx.history
        ]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.decided.append(call)


def test_a_siblings_decision_during_the_turn_is_planned_again_only_when_asked() -> None:
    """``reask``: rollout 1's turn (0-5 s) asks again when rollout 0 decides a read at 1 s, after an ``ls`` (another
    state); run in place, it hides what is left of the turn. Rollout 0's ``ls`` at 0.5 s, decided in rollout 1's
    state, is not launched: the cache's."""
    group = {"t": [_record(("ls", 0.5, 0.1), ("cat log", 0.4, 10.0)), _record(("cat log", 5.0, 10.0))]}

    def make(task: str) -> Callable[[], Sequence[Predictor]]:
        decided: list[CallKey] = []
        return lambda: [_Told(decided)]

    once = replay(group, make)
    assert once.total().get("launched", 0) == 0
    again = replay(group, make, reask=True)
    seen = again.total()
    assert (seen["replanned"], seen["launched"], seen["hits"]) == (1, 1, 1)
    assert seen["hidden"] == pytest.approx(5.0 - 1.0)
    assert again.rollouts["t"][1].hidden == pytest.approx(seen["hidden"])
