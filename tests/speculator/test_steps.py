"""The next case of a run the rollout steps through, and only once a step was taken."""

from __future__ import annotations

import pytest

from bunshin_async.speculation import CallKey, PredictionContext
from bunshin_async.tools import bash_tool
from speculator import StepPredictor

pytestmark = pytest.mark.unit

BASH = bash_tool()


def _key(command: str) -> CallKey:
    return CallKey.of(BASH, {"command": command})


def _guesses(*commands: str, decided: tuple[str, ...] = (), reach: int = 8) -> list[tuple[str, float]]:
    ctx = PredictionContext(
        history=tuple(_key(c) for c in commands),
        chain=b"",
        turn=len(commands),
        position=len(decided),
        decided=tuple(_key(c) for c in decided),
    )
    return [(c.arguments["command"], c.probability) for c in StepPredictor(reach=reach).predict(ctx)]


def test_a_step_taken_is_taken_again() -> None:
    assert _guesses("python3 maze.py 1", "cat out/1.txt", "python3 maze.py 2") == [("python3 maze.py 3", 0.6)]
    # the number that stepped, not another one of the command (the timeout stayed)
    assert _guesses("cd /app && timeout 30 python3 x.py 9", "cd /app && timeout 30 python3 x.py 10") == [
        ("cd /app && timeout 30 python3 x.py 11", 0.6)
    ]
    # a call decided earlier in the message counts as the latest one
    assert _guesses("./run.sh 4", decided=("./run.sh 5",)) == [("./run.sh 6", 0.6)]


@pytest.mark.parametrize(
    "commands",
    [
        ("python3 maze.py 1",),  # one case alone: no step yet
        ("python3 maze.py 1", "python3 maze.py 3"),  # not a step of one
        ("python3 maze.py 2", "python3 maze.py 1"),  # down, not up
        ("python3 maze.py 1", "python3 other.py 2"),  # another command
        ("pip install x==1", "pip install x==2"),  # a version, not a case
        ("sleep 1 && cat a.log", "sleep 2 && cat b.log"),  # two things changed
        ("sed -n '1,20p' a.py", "sed -n '2,20p' a.py"),  # a read, not a run
        ("grep -C 3 x a.py", "grep -C 4 x a.py"),
        ("python3 maze.py 1", "python3 maze.py 2", "python3 maze.py 3", "python3 maze.py 2"),  # 3 was run already
        ("cat > a.py << 'EOF'\nx = 1\nEOF", "cat > a.py << 'EOF'\nx = 2\nEOF"),  # a heredoc's text is not a case
        (),
    ],
)
def test_no_step_no_guess(commands: tuple[str, ...]) -> None:
    assert _guesses(*commands) == []


def test_the_step_must_be_within_reach() -> None:
    history = ("python3 maze.py 1", "ls", "ls -la", "python3 maze.py 2")
    assert _guesses(*history, reach=3) == [("python3 maze.py 3", 0.6)]
    assert _guesses(*history, reach=2) == []
