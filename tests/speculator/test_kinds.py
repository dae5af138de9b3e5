"""Odds by the kind of call: the kind a command is, the odds factor a guess of it gets, and how factors are fitted."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from bunshin_async.speculation import CallKey, Candidate, PredictionContext
from bunshin_async.tools import bash_tool
from speculator import KIND_ODDS, KindOdds, SiblingTable, call_kind, default_speculation, fit_odds

pytestmark = pytest.mark.unit

BASH = bash_tool()


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        ("pip3 install yt-dlp", "install"),
        ("mkdir -p /app/cache && pip install transformers torch", "install"),
        ("python3 -c 'import flask' 2>/dev/null || pip install flask", "install"),
        ("apt-get update && apt-get install -y build-essential", "install"),
        ("python3 -m pip install numpy", "install"),
        ("cat <<'EOF' > run.py\nprint(1)\nEOF", "edit"),
        ("sed -i 's/5000/5001/' api.py", "edit"),
        ("mkdir -p out", "edit"),
        ("./cli_tool weights.json image.png > prediction.txt", "run"),  # computes; the redirect keeps its output
        ("python3 train.py > train.log 2>&1", "run"),
        ("nohup python3 api.py > api.log 2>&1 &", "run"),
        ("echo 'x = 1' > conf.py", "edit"),
        ("sed 's/5000/5001/g' api.py > api2.py", "edit"),
        ("ls -la", "read"),
        ("cd /app && cat model.py", "read"),
        ("which yt-dlp ffmpeg", "read"),
        ("python3 train.py --epochs 3", "run"),
        ("make", "run"),
        ("yt-dlp -f mp4 https://example.com/v", "run"),
        ("pip list | grep torch", "run"),  # pip, but not an install
    ],
)
def test_a_command_has_the_kind_of_what_it_does(command: str, kind: str) -> None:
    assert call_kind("bash", {"command": command}) == kind


@pytest.mark.parametrize(
    ("command", "manager"),
    [
        ("pip3 install yt-dlp", "pip3"),
        ("mkdir -p x && python3 -m pip install numpy", "python3 -m pip"),
        ("apt update && apt install -y ffmpeg", "apt"),
        ("npm add left-pad", "npm"),
        ("pip list | grep install", None),  # the word after the pipe is not pip's
        ("pip show install-tool", None),
        ("git add install.sh", None),
    ],
)
def test_one_definition_of_an_install_names_its_manager(command: str, manager: str | None) -> None:
    from speculator._signature import installer

    assert installer(command) == manager


def test_a_call_without_a_command_is_of_no_shell_kind() -> None:
    assert call_kind("read_file", {"path": "x"}) == "other"


class _Fixed:
    name = "siblings"

    def __init__(self, guesses: Sequence[tuple[str, float]]) -> None:
        self.guesses = guesses
        self.observed: list[CallKey] = []

    def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
        return [
            Candidate(name="bash", arguments={"command": c}, probability=p, source=self.name) for c, p in self.guesses
        ]

    def observe(self, ctx: PredictionContext, call: CallKey) -> None:
        self.observed.append(call)


def test_a_guess_has_its_odds_multiplied_by_its_kinds_factor() -> None:
    inner = _Fixed([("python3 run.py", 0.4), ("cat > a.txt", 0.5), ("ls", 0.3), ("python3 sure.py", 1.0)])
    wrapped = KindOdds(inner, {"run": 2.0, "edit": 0.25})
    assert wrapped.name == "siblings"  # it is that predictor: ablations leave it out by name
    ctx = PredictionContext(history=(), chain=b"", turn=0, position=0)
    got = {c.arguments["command"]: c.probability for c in wrapped.predict(ctx)}
    # odds 0.4/0.6 x 2 = 4/3 -> 4/7; odds 1 x 0.25 -> 0.2; a kind without a factor keeps its odds; certainty stays
    assert got == pytest.approx({"python3 run.py": 4 / 7, "cat > a.txt": 0.2, "ls": 0.3, "python3 sure.py": 1.0})
    call = CallKey.of(BASH, {"command": "ls"})
    wrapped.observe(ctx, call)
    assert inner.observed == [call]


def test_a_second_source_of_a_predictor_has_its_own_factors() -> None:
    """A predictor whose guesses carry another source besides its name (its ``sources``: the observation
    predictor's forms) gets that source's factors for them, fitted apart, and its own for the rest."""
    from speculator import with_kind_odds

    class _Two(_Fixed):
        sources = ("siblings-weak",)

        def predict(self, ctx: PredictionContext) -> Sequence[Candidate]:
            strong, weak = super().predict(ctx)
            return [strong, msgspec.structs.replace(weak, source="siblings-weak")]

    ctx = PredictionContext(history=(), chain=b"", turn=0, position=0)
    two = _Two([("pip install a", 0.5), ("pip install b", 0.5)])
    (wrapped,) = with_kind_odds([two], {"siblings-weak": {"install": 0.25}})
    assert [c.probability for c in wrapped.predict(ctx)] == pytest.approx([0.5, 0.2])
    (wrapped,) = with_kind_odds([two], {"siblings": {"install": 3.0}, "siblings-weak": {"install": 0.25}})
    assert [c.probability for c in wrapped.predict(ctx)] == pytest.approx([0.75, 0.2])
    assert with_kind_odds([two], {"other": {"install": 2.0}}) == [two]


def test_factors_follow_how_often_each_kind_of_guess_came() -> None:
    # runs stated 0.25 came half the time, edits stated 0.5 one time in ten, reads as stated
    guesses = [("s", "run", 0.25, n % 2 == 0) for n in range(60)]
    guesses += [("s", "edit", 0.5, n % 10 == 0) for n in range(60)]
    guesses += [("s", "read", 0.4, n % 5 < 2) for n in range(60)]
    guesses += [("s", "install", 0.01, False) for _ in range(500)]  # under the floor: never launched, not fitted
    guesses += [("t", "run", 0.5, True), ("t", "run", 0.5, True)]  # two guesses: the prior keeps it near 1
    odds = fit_odds(guesses)
    assert 2.0 < odds["s"]["run"] < 3.0  # the odds that fit exactly: 1 / (1/3) = 3, shrunk towards 1
    assert 1 / 9 < odds["s"]["edit"] < 0.35  # exactly: (1/9) / 1
    assert "read" not in odds["s"] and "install" not in odds["s"]
    assert odds.get("t", {}).get("run", 1.0) < 1.5  # two hits at 0.5 would fit any factor above 1


def test_default_speculation_states_odds_by_kind_unless_told_otherwise() -> None:
    table = SiblingTable()
    table.add(b"c", CallKey.of(BASH, {"command": "python3 run.py"}))
    ctx = PredictionContext(history=(), chain=b"c", turn=0, position=0)

    def stated(**kwargs: object) -> float:
        spec = default_speculation(table=table, **kwargs)  # type: ignore[arg-type]
        siblings = next(p for p in spec.predictors if p.name == "siblings")
        return siblings.predict(ctx)[0].probability

    assert stated(odds={}) == pytest.approx(0.9)  # one sibling made it from this history: 0.9 x 1/1
    factor = KIND_ODDS["siblings"]["run"]
    assert stated() == pytest.approx(0.9 * factor / (0.1 + 0.9 * factor))
    assert stated(odds={"siblings": {"run": 0.5}}) == pytest.approx(0.45 / 0.55)


def _record(task: str, rollout: int, commands: Sequence[str]) -> dict[str, object]:
    steps = [
        {"tool": "bash", "args": {"command": c}, "llm_seconds": 2.0 + rollout, "tool_seconds": 1.0} for c in commands
    ]
    return {"task_id": task, "rollout": rollout, "steps": steps}


def test_held_out_odds_fit_each_task_on_the_other_tasks_only() -> None:
    from speculator import held_out_odds

    # siblings that repeat each other's runs: after the same history, the same run (the next call every time)
    same = ["ls", "python3 a.py", "python3 b.py", "python3 c.py"]
    groups = {t: [_record(t, r, same) for r in range(3)] for t in ("a", "b", "c")}
    odds = held_out_odds(groups)
    assert odds["a"] == odds["b"] == odds["c"]  # the tasks are alike: so are their factors
    # task a's rollouts now diverge: its own factors do not change, the others' do (they are fitted on a's guesses)
    groups["a"] = [_record("a", r, ["ls", f"python3 x{r}.py", f"python3 y{r}.py", "ls -la"]) for r in range(3)]
    again = held_out_odds(groups)
    assert again["a"] == odds["a"]
    assert again["b"] != odds["b"] and again["b"] == again["c"]


def test_each_tasks_factors_are_fitted_on_the_other_tasks_only() -> None:
    from speculator._kinds import fit_held_out

    # task a's runs always came, task b's never: each is measured with the other's evidence, never its own
    guesses = [("a", "s", "run", 0.3, True)] * 40 + [("b", "s", "run", 0.3, False)] * 40
    fits = fit_held_out(guesses, ["a", "b", "c"])
    assert fits["a"]["s"]["run"] < 1 < fits["b"]["s"]["run"]
    assert fits["c"] == fit_odds(g[1:] for g in guesses)  # a task without guesses: fitted on all


def test_the_install_search_agrees_with_the_one_definition_and_is_linear() -> None:
    """``installer`` answers as ``INSTALL.search`` does (seeded command lines of managers, verbs, look-alikes and
    separators), without the regex's backtracking from each manager word to its segment's end: one segment of
    a megabyte of ``pip pip ...`` is answered at once (the regex took 14 s over 64 KB, quadratically more here)."""
    import random

    from speculator._signature import INSTALL, installer

    words = [
        "pip", "pip3", "pip3.11", "python3 -m pip", "python -m\npip", "python3", "-m", "apt", "apt-get", "go", "uv",
        "npm", "install", "add", "install.log", "-install", "reinstall", "add-on", "pipx", "uvx", "x", "cat", "|",
        "||", "&&", ";", "&", "\n",
    ]  # fmt: skip
    rng = random.Random(20)
    for _ in range(5000):
        command = " ".join(rng.choice(words) for _ in range(rng.randint(1, 9)))
        m = INSTALL.search(command)
        assert installer(command) == (m["manager"] if m else None), command
    assert installer("pip " * 250_000) is None
    assert installer("pip " * 250_000 + "install x") == "pip"
