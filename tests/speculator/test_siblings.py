"""What sibling rollouts did next: by the same history, the same previous call, or a previous call that began with
the same line; empty observations are no evidence."""

from __future__ import annotations

import pytest

from bunshin_async.speculation import CallKey, PredictionContext
from bunshin_async.tools import bash_tool
from speculator import SiblingPredictor, SiblingTable

pytestmark = pytest.mark.unit

BASH = bash_tool()


def _key(command: str) -> CallKey:
    return CallKey.of(BASH, {"command": command})


def _ctx(*commands: str, output: str = "") -> PredictionContext:
    history = tuple(_key(c) for c in commands)
    return PredictionContext(
        history=history, chain=b"/".join(c.encode() for c in commands), turn=len(commands), position=0,
        last_output=output,
    )  # fmt: skip


def _guesses(predictor: SiblingPredictor, ctx: PredictionContext) -> list[tuple[str, float]]:
    return [(c.arguments["command"], round(c.probability, 3)) for c in predictor.predict(ctx)]


def test_a_heredoc_that_wrote_the_same_file_is_followed_by_the_siblings_run() -> None:
    table = SiblingTable()
    sibling, mine = SiblingPredictor(table), SiblingPredictor(table)
    theirs = "cat <<'EOF' > explore.py\nimport os\nEOF"
    sibling.observe(_ctx("ls", theirs), _key("timeout 60 python3 explore.py 1"))
    # other contents, other history: same first line, so the sibling's run, at the first line's odds
    ours = "cat <<'EOF' > explore.py\nimport sys\nprint(sys.argv)\nEOF"
    assert _guesses(mine, _ctx("pwd", ours)) == [("timeout 60 python3 explore.py 1", 0.4)]
    # another file's heredoc, or a one-line command that matches no sibling's: nothing
    assert _guesses(mine, _ctx("pwd", "cat <<'EOF' > other.py\nimport os\nEOF")) == []
    assert _guesses(mine, _ctx("pwd", "cat <<'EOF' > explore.py")) == []
    # the same previous call exactly: the sibling's next call after it (whatever came before), at its odds
    assert _guesses(mine, _ctx("pwd", theirs)) == [("timeout 60 python3 explore.py 1", 0.2)]
    # the same history: what the sibling did, near certain
    assert _guesses(mine, _ctx("ls", theirs)) == [("timeout 60 python3 explore.py 1", 0.9)]


def test_an_empty_observation_is_no_evidence() -> None:
    table = SiblingTable()
    sibling, mine = SiblingPredictor(table), SiblingPredictor(table)
    sibling.observe(_ctx("ls", "mkdir -p out", output=""), _key("python3 run.py"))
    sibling.observe(_ctx("pwd", "mkdir -p out", output=""), _key("ls out"))
    # both followed an empty output: what followed the call, at the after-the-same-call odds, not the seen odds
    after = sorted(_guesses(mine, _ctx("cat a", "mkdir -p out", output="")))
    assert after == [("ls out", 0.1), ("python3 run.py", 0.1)]
    # a non-empty observation a sibling saw after the same call is evidence
    sibling.observe(_ctx("id", "mkdir -p out", output="mkdir: exists\n"), _key("rm -rf out"))
    assert _guesses(mine, _ctx("cat a", "mkdir -p out", output="mkdir: exists\n")) == [("rm -rf out", 0.8)]


def test_a_call_two_siblings_made_after_the_same_call_is_likelier() -> None:
    table = SiblingTable()
    one, two, mine = SiblingPredictor(table), SiblingPredictor(table), SiblingPredictor(table)
    one.observe(_ctx("ls", "make"), _key("./bench"))
    assert _guesses(mine, _ctx("pwd", "make")) == [("./bench", 0.2)]
    two.observe(_ctx("id", "make"), _key("./bench"))
    assert _guesses(mine, _ctx("pwd", "make")) == [("./bench", 0.4)]
    # split between two calls: each as likely as a single sibling's
    two.observe(_ctx("uname", "make"), _key("make test"))
    assert _guesses(mine, _ctx("pwd", "make")) == [("./bench", 0.267), ("make test", 0.067)]
