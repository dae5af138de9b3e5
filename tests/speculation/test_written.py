"""The first run of a script the rollout just wrote: where the command writes it, and the run's form learned from
the rollout, then its siblings, else the extension's interpreter."""

from __future__ import annotations

import pytest

from bunshin_async.speculation import CallKey, PredictionContext
from bunshin_async.tools import bash_tool
from speculator import SiblingTable, WrittenPredictor
from speculator._written import runs_written, written_script

pytestmark = pytest.mark.unit

BASH = bash_tool()


def _key(command: str) -> CallKey:
    return CallKey.of(BASH, {"command": command})


def _ctx(*commands: str) -> PredictionContext:
    return PredictionContext(history=tuple(_key(c) for c in commands), chain=b"", turn=len(commands), position=0)


def _commands(predictor: WrittenPredictor, ctx: PredictionContext) -> list[tuple[str, float]]:
    return [(c.arguments["command"], round(c.probability, 3)) for c in predictor.predict(ctx)]


@pytest.mark.parametrize(
    ("command", "path"),
    [
        ("cat > solve.py << 'EOF'\nprint(1)\nEOF", "solve.py"),
        ("cat <<EOF > /app/run.sh\necho > x.py\nEOF", "/app/run.sh"),
        ("cd /app && cat >> 'fix.py' <<'PY'\nx = 1\nPY", "fix.py"),
        ("tee /tmp/check.js << 'EOF'\nconsole.log(1)\nEOF", "/tmp/check.js"),
        ("echo 'print(2)' > t.py", "t.py"),
        ("cat > notes.txt << 'EOF'\nhi\nEOF", None),  # not a script
        ("cat data.json > x.json", None),
        ("python3 solve.py > out.txt", None),  # a run that writes its output, not a script
        ("cat solve.py", None),
        ("ls 2> err.sh", None),  # a redirection of a program that is not writing text
    ],
)
def test_the_script_a_command_writes_is_read_from_its_first_line(command: str, path: str | None) -> None:
    assert written_script(command) == path


def test_a_written_script_is_run_in_the_form_the_rollout_then_its_siblings_used() -> None:
    table = SiblingTable()
    mine, sibling = WrittenPredictor(table), WrittenPredictor(table)
    write = "cat > explore.py << 'EOF'\nimport os\nEOF"
    # nothing learned: the interpreter its extension names, at the default odds
    assert _commands(mine, _ctx("ls", write)) == [("python3 explore.py", 0.4)]
    assert _commands(mine, _ctx("ls")) == []  # the last call wrote nothing
    # a sibling ran its own script with a timeout and an argument: that form, for this rollout's new script
    sibling.observe(_ctx("ls", "cat > maze.py << 'EOF'\npass\nEOF"), _key("timeout 30 python3 maze.py 1"))
    assert _commands(mine, _ctx("ls", write)) == [("timeout 30 python3 explore.py 1", 0.7)]
    # the rollout's own form comes first (the group has now used each form once: half its odds, as likely); a full
    # path fills the path, a bare name the name
    mine.observe(_ctx("cat > /app/a.py << 'EOF'\nEOF"), _key("cd /app && python3 /app/a.py"))
    assert _commands(mine, _ctx("cat > /app/b.py << 'EOF'\nEOF")) == [
        ("cd /app && python3 /app/b.py", 0.35),
        ("timeout 30 python3 b.py 1", 0.35),
    ]
    # a call after the write that does not run it (another heredoc, an unrelated command) teaches nothing
    before = dict(table.templates)
    mine.observe(_ctx(write), _key("cat > other.py << 'EOF'\nexplore.py\nEOF"))
    mine.observe(_ctx(write), _key("ls -la"))
    assert dict(table.templates) == before
    # another kind of script: its own forms (none yet), so its interpreter
    assert _commands(mine, _ctx("cat > run.sh << 'EOF'\nEOF")) == [("bash run.sh", 0.4)]


def test_a_fresh_script_runs_with_the_interpreter_the_rollout_types() -> None:
    write = "cat > solve.py << 'EOF'\nprint(1)\nEOF"
    mine = WrittenPredictor(SiblingTable())
    assert _commands(mine, _ctx('python -c "import sys"', write)) == [("python solve.py", 0.4)]
    assert _commands(mine, _ctx("timeout 5 python3.11 x.py", "ls", write)) == [("python3.11 solve.py", 0.4)]
    assert _commands(mine, _ctx("pythonista", "ls", write)) == [("python3 solve.py", 0.4)]  # not an interpreter
    assert _commands(mine, _ctx("python -V", "cat > run.sh << 'EOF'\nEOF")) == [("bash run.sh", 0.4)]


@pytest.mark.parametrize(
    ("command", "path", "runs"),
    [
        ("cat <<'EOF' > x.py\nprint(1)\nEOF\n\npython3 x.py", "x.py", True),
        ("cat > /app/x.py << 'EOF'\nimport os\nEOF\ncd /app && timeout 30 python3 /app/x.py 1", "/app/x.py", True),
        ("cat <<'EOF' > x.py\nprint(1)\nEOF\npython3 -u 'x.py' --n 3", "x.py", True),
        ("echo 'ls' > run.sh && bash run.sh", "run.sh", True),
        ("echo 'ls' > run.sh && chmod +x run.sh && ./run.sh", "run.sh", True),
        ("cat <<'EOF' > x.py\nprint(1)\nEOF", "x.py", False),
        ("echo 'ls' > run.sh && chmod +x run.sh", "run.sh", False),
        ("cat <<'EOF' > x.py\n# usage: python3 x.py\nEOF", "x.py", False),  # the script's text, not a run
        ("cat <<'EOF' > x.py\nprint(1)\nEOF\ncat x.py", "x.py", False),
        ("cat <<'EOF' > x.py\nprint(1)\nEOF\npython3 other_x.py", "x.py", False),
    ],
)
def test_a_command_that_writes_a_script_may_run_it_too(command: str, path: str, runs: bool) -> None:
    assert runs_written(command, path) is runs


def test_a_script_the_writing_command_already_ran_gets_no_first_run() -> None:
    # the traces: after such a command the next call was never the script's first run (0 of 66)
    mine = WrittenPredictor(SiblingTable())
    assert _commands(mine, _ctx("ls", "cat > a.py << 'EOF'\nprint(1)\nEOF\npython3 a.py")) == []
    assert _commands(mine, _ctx("ls", "cat > a.py << 'EOF'\nprint(1)\nEOF")) != []


def test_a_siblings_form_is_as_likely_as_its_share_of_their_first_runs() -> None:
    table = SiblingTable()
    mine, sibling = WrittenPredictor(table), WrittenPredictor(table)
    for n, run in enumerate(["timeout 9 python3 s{}.py", "python3 s{}.py", "python3 s{}.py", "python3 s{}.py"]):
        sibling.observe(_ctx(f"cat > s{n}.py << 'EOF'\nEOF"), _key(run.format(n)))
    odds = dict(_commands(mine, _ctx("cat > new.py << 'EOF'\nEOF")))
    assert odds["python3 new.py"] == pytest.approx(3 * odds["timeout 9 python3 new.py"])
