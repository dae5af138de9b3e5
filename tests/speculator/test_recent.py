"""The rollout's own runs repeated after an edit or an install, at the odds such guesses scored."""

from __future__ import annotations

import pytest

from bunshin_async.speculation import CallKey, PredictionContext
from bunshin_async.tools import bash_tool
from speculator import RecentPredictor

pytestmark = pytest.mark.unit

BASH = bash_tool()


def _ctx(*commands: str) -> PredictionContext:
    history = tuple(CallKey.of(BASH, {"command": c}) for c in commands)
    return PredictionContext(history=history, chain=b"", turn=len(commands), position=0)


def _guesses(*commands: str) -> list[tuple[str, float]]:
    return [(c.arguments["command"], round(c.probability, 3)) for c in RecentPredictor().predict(_ctx(*commands))]


def test_a_run_that_names_the_edited_file_comes_first_and_likeliest() -> None:
    # the older run names the file the edit changed: repeated first, at the named odds; the other one decayed
    assert _guesses("python3 solve.py 1", "python -m pytest -q", "sed -i 's/a/b/' solve.py") == [
        ("python3 solve.py 1", 0.55),
        ("python -m pytest -q", 0.25),
    ]
    # a heredoc that rewrites the file a run used: that run, as likely as a coin flip
    assert _guesses("cd /app && python3 solve.py", "cat > /app/solve.py <<'EOF'\nx = 1\nEOF") == [
        ("cd /app && python3 solve.py", 0.55)
    ]


def test_a_new_file_written_whole_rarely_brings_back_an_old_run() -> None:
    # the script just written is what runs next (the written predictor's guess), not the rollout's older run
    assert _guesses("python3 explore.py", "cat > solve.py <<'EOF'\nx = 1\nEOF") == [("python3 explore.py", 0.01)]
    # an in-place edit of another file: now and then
    assert _guesses("python -m pytest -q", "sed -i 's/a/b/' setup.cfg") == [("python -m pytest -q", 0.25)]
    # a name inside another word is not the file (``a.py`` in ``data.py``)
    assert _guesses("python3 data.py", "sed -i 's/x/y/' a.py") == [("python3 data.py", 0.25)]


def test_after_an_install_the_last_run_again_never_an_install() -> None:
    assert _guesses("python3 train.py", "pip install -q torch") == [("python3 train.py", 0.45)]
    assert _guesses("pip install numpy", "python3 -m pip install scipy") == []
    assert _guesses("python3 train.py", "pip list") == []  # not an install, not an edit
    # an install anywhere in the command line is one (as for the kinds of call): the run failed for want of it
    assert _guesses("python3 train.py", "mkdir -p cache && pip install torch") == [("python3 train.py", 0.45)]


def test_reads_after_the_change_still_lead_to_the_run_other_calls_do_not() -> None:
    edit = "sed -i 's/a/b/' solve.py"
    # the agent looks at what it changed (reads, up to three) before checking it
    assert _guesses("python3 solve.py", edit, "nl -ba solve.py | head", "grep -n b solve.py") == [
        ("python3 solve.py", 0.55)
    ]
    assert _guesses("python3 solve.py", edit, "cat a", "cat b", "cat c", "cat d") == []  # too long ago
    assert _guesses("python3 solve.py", edit, "mkdir out") == []  # not a read: something else is going on
    assert _guesses("python3 solve.py", edit, "python3 solve.py") == []  # the run already checked the change


def test_a_heredoc_that_rewrites_a_file_used_before_brings_the_run_back() -> None:
    rewrite = "cat > csvtool/core.py <<'EOF'\nrows = rows[1:]\nEOF"
    # the rollout read the module before: a rewrite of it, checked by the tests it ran
    assert _guesses("python -m unittest -q", "cat csvtool/core.py", rewrite) == [("python -m unittest -q", 0.5)]
    # never named before: a new file, which is what runs next, not the tests
    assert _guesses("python -m unittest -q", "cat csvtool/cli.py", rewrite) == [("python -m unittest -q", 0.01)]


def test_the_edited_files_are_read_word_by_word_and_an_overlong_word_names_none() -> None:
    from speculator._recent import _edited

    edit = CallKey.of(BASH, {"command": "sed -i 's/a/b/' src/solve.py 'conf.yaml' --out=x.json"})
    assert _edited(edit) == {"solve.py", "conf.yaml", "x.json"}
    # a word longer than any file name (here 64 KiB of path characters) is no file's name, and is not searched
    long = CallKey.of(BASH, {"command": f"sed -i 's/a/b/' {'a/' * 32768}z.py solve.py"})
    assert _edited(long) == {"solve.py"}
