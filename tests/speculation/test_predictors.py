"""Predictors and policy, without workspaces."""

from __future__ import annotations

import pytest

from bunshin_async.speculation import CallKey, Candidate, Launch, PredictionContext, chain_root, extend_chain
from bunshin_async.speculation import canonical_args as canon
from bunshin_async.tools import Effect, bash_tool
from speculator import (
    CostAwarePolicy,
    DocsPredictor,
    HistoryPredictor,
    NgramModel,
    Rule,
    RulePredictor,
    SiblingPredictor,
    SiblingTable,
    default_ngram,
    signature,
)

pytestmark = pytest.mark.unit

BASH = bash_tool()


def chain(history: list[CallKey], salt: str = "") -> bytes:
    """The chain key the runtime computes for ``history`` (``WorkspaceHandle.chain``)."""
    key = chain_root(salt)
    for call in history:
        key = extend_chain(key, call)
    return key


def key(cmd: str) -> CallKey:
    return CallKey.of(BASH, {"command": cmd})


def ctx(*cmds: str) -> PredictionContext:
    history = tuple(key(c) for c in cmds)
    return PredictionContext(history=history, chain=chain(history), turn=len(cmds), position=0)


def test_canonical_arguments_fill_defaults_and_sort() -> None:
    assert canon(BASH, {"command": "ls"}) == canon(BASH, {"timeout": 120, "command": "ls"})
    assert key("ls") == key("ls") and key("ls") != key("ls -la")


def test_siblings_predict_what_the_group_did_from_the_same_history() -> None:
    table = SiblingTable()
    a, b = SiblingPredictor(table), SiblingPredictor(table)
    a.observe(ctx("ls"), key("cat README"))
    b.observe(ctx("ls"), key("cat README"))
    b.observe(ctx("ls"), key("pytest"))
    [top, second] = SiblingPredictor(table, confidence=1.0).predict(ctx("ls"))
    assert (top.arguments["command"], round(top.probability, 2)) == ("cat README", 0.67)
    assert second.arguments["command"] == "pytest"
    assert SiblingPredictor(table).predict(ctx("pwd")) == []


def seen(output: str, *cmds: str) -> PredictionContext:
    """``ctx(*cmds)`` whose latest call printed ``output``."""
    history = tuple(key(c) for c in cmds)
    return PredictionContext(history=history, chain=chain(history), turn=len(cmds), position=0, last_output=output)


README = """# tool
Install a dependency with `python3 -m pip install --no-index ./vendor/NAME` (or all with `make deps`).
Use it as `from tool import run`.
```console
$ pytest -q tests/
```
"""
ERROR = "E   ModuleNotFoundError: No module named 'fastcsv'\n1 failed\n"


def test_docs_fill_a_quoted_command_with_what_the_error_names() -> None:
    docs = DocsPredictor()
    docs.observe(seen(README, "ls", "cat README.md"), key("pytest -q tests/"))
    # only the command with a hole for it: the others (``make deps``, the test run) do not name the module
    [first] = docs.predict(seen(ERROR, "ls", "cat README.md", "pytest -q tests/"))
    assert first.arguments == {"command": "python3 -m pip install --no-index ./vendor/fastcsv"}
    assert first.name == "bash" and first.source == "docs" and first.probability == docs.confidence
    # the quoted commands, and nothing else: prose in backticks that is not a command is not one
    assert list(docs.commands) == [
        "python3 -m pip install --no-index ./vendor/NAME",
        "make deps",
        "pytest -q tests/",
    ]
    # a command quoted with the entity already in it, from the error itself, comes first (the latest read)
    hint = "bash: jq: command not found\nhint: install it with `apt-get install -y jq`\n"
    [top, *_] = docs.predict(seen(hint, "ls", "jq . data.json"))
    assert top.arguments == {"command": "apt-get install -y jq"}


def test_docs_predict_nothing_without_an_entity_or_a_shell_tool() -> None:
    docs = DocsPredictor()
    docs.observe(seen(README, "ls", "cat README.md"), key("pytest -q tests/"))
    assert docs.predict(seen("2 passed\n", "ls", "cat README.md", "pytest -q tests/")) == []
    no_shell = PredictionContext(history=(), chain=chain(()), turn=0, position=0, last_output=ERROR)
    assert docs.predict(no_shell) == []


def test_history_predicts_a_rerun_after_an_edit() -> None:
    model = NgramModel()
    for _ in range(20):
        model.add_sequence([("bash", {"command": "python t.py"}), ("bash", {"command": "sed -i s/a/b/ t.py"}),
                            ("bash", {"command": "python t.py"})])  # fmt: skip
    cands = HistoryPredictor(model).predict(ctx("python t.py", "sed -i s/x/y/ t.py"))
    assert cands and cands[0].arguments["command"] == "python t.py" and cands[0].probability > 0.5


def test_signatures_keep_the_command_not_its_directory() -> None:
    assert signature("bash", {"command": "cd /x && python -m pytest -q"}) == "bash:python -m pytest"


def test_rules() -> None:
    rules = RulePredictor([
        Rule(at_start=True, then_tool="bash", then_args={"command": "ls -la"}, probability=0.8),
        Rule(after=r"^pip install", then_tool="bash", then_args={"command": "pytest"}, probability=0.5),
    ])  # fmt: skip
    assert [c.arguments["command"] for c in rules.predict(ctx())] == ["ls -la"]
    assert [c.arguments["command"] for c in rules.predict(ctx("pip install -e ."))] == ["pytest"]
    assert rules.predict(ctx("ls")) == []


def test_policy_weighs_saving_against_the_fork_and_learns() -> None:
    policy = CostAwarePolicy(
        max_forks=1, fork_seconds=0.2, default_seconds=0.1, contention=None, loop_load=None, memory_weight=0.0
    )

    def launch(cmd: str, p: float, effect: Effect, seconds: float | None = None) -> Launch:
        cand = Candidate(name="bash", arguments={"command": cmd}, probability=p, expected_seconds=seconds)
        return Launch(candidate=cand, key=key(cmd), effect=effect)

    slow, quick, read = (
        launch("make", 0.9, Effect.WRITE, 2.0),
        launch("touch x", 0.9, Effect.WRITE),
        launch("cat x", 0.3, Effect.READ),
    )
    chosen = policy.select([quick, read, slow], running=0, forks=0)
    assert chosen == [slow, read]  # the quick write is not worth a fork; one fork at most
    assert policy.select([slow], running=0, forks=1) == []
    for _ in range(5):
        policy.observe_tool(key("touch x"), 3.0)  # it turns out to be slow
    assert policy.select([quick], running=0, forks=0) == [quick]
    policy.observe_fork(5.0, 1 << 20)
    assert policy.select([slow], running=0, forks=0) == []  # forks got expensive


def test_the_bundled_table_round_trips() -> None:
    bundled = default_ngram()  # package data: no trace file needed
    again = NgramModel.from_table(bundled.to_table(min_count=1))
    assert dict(again.counts) == dict(bundled.counts)
    with pytest.raises(ValueError, match="not an n-gram table"):
        NgramModel.from_table(b"junk")
