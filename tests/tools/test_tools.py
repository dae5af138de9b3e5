"""The tool model: effect classes, the shell classifier, MCP annotations, argument normalization."""

from __future__ import annotations

import pytest

from bunshin_async import InvalidArgument
from bunshin_async.tools import CallClass, Effect, Tool, bash_tool, builtin_tools, classify_command

pytestmark = pytest.mark.unit

R, W, X = Effect.READ, Effect.WRITE, Effect.EXTERNAL


@pytest.mark.parametrize(
    ("command", "effect", "deterministic"),
    [
        ("ls -la", R, True),
        ("cat a.py | grep foo | wc -l", R, True),
        ("cd /testbed && grep -rn 'def f' src | head -20", R, True),
        ("git status && git diff HEAD~1", R, True),
        ("git -C repo log --oneline -5", R, True),
        ("find . -name '*.py' | xargs grep -l foo", R, True),
        ("find . -name x -exec grep -l foo {} \\;", R, True),
        ("sed -n '10,20p' a.py", R, True),
        ("nl -ba a.py | sed -n 1,5p", R, True),
        ("ls 2>&1 | tail -3", R, True),
        ("ls > /dev/null 2>&1", R, True),
        ("(cd src; ls); ls", R, True),
        ("ls\ncat README.md", R, True),
        ("timeout 5 grep -r foo .", R, True),
        ("echo hi > out.txt", W, True),
        ("echo hi >> out.txt", W, True),
        ("cat a | tee b", W, True),
        ("sed -i 's/a/b/' f.py", W, True),
        ("sed 's/a/b/' f.py", W, True),
        ("ls && rm -rf build", W, True),
        ("python reproduce.py", W, True),
        ("pip install -e .", W, True),
        ("git checkout -b x", W, True),
        ("find . -name '*.pyc' -delete", W, True),
        ("ls | xargs rm", W, True),
        ("grep foo $(find . -name '*.py')", W, True),
        ("cat <<'EOF' > f.py\nprint(1)\nEOF", W, True),
        ("sort -o out in", W, True),
        ("frobnicate --all", W, True),
        ("date", R, False),
        ("echo $RANDOM", R, False),
        ("head -c 16 /dev/urandom | od", R, False),
        ("curl -s http://example.com", X, False),
        ("git clone https://x/y.git", X, False),
        ("it's unbalanced", W, True),
    ],
)
def test_classify_command(command: str, effect: Effect, deterministic: bool) -> None:
    assert classify_command(command) == CallClass(effect, deterministic)


def test_classifier_extensions_and_overrides() -> None:
    assert classify_command("pytest -q").effect is W
    assert classify_command("mytool --show", read_only=["mytool"]).effect is R
    assert classify_command("roll", nondeterministic=["roll"]).deterministic is False
    tool = bash_tool(read_only=["mytool"])
    assert tool.classify_call({"command": "mytool x | head"}) == CallClass(R)
    fixed = tool.with_effect("read")
    assert fixed.classify_call({"command": "rm -rf /"}) == CallClass(R)


def test_builtin_tools_declare_their_classes() -> None:
    tools = {t.name: t for t in builtin_tools()}
    assert set(tools) == {"bash", "read_file", "write_file", "list_dir", "python"}
    assert tools["read_file"].effect is R and tools["list_dir"].effect is R
    assert tools["write_file"].effect is W and tools["python"].effect is W
    assert all(t.handler is not None for t in tools.values())
    assert tools["bash"].spec()["function"]["parameters"]["required"] == ["command"]


async def _noop(ws: object, args: dict[str, object]) -> None:
    return None


@pytest.mark.parametrize(
    ("annotations", "effect"),
    [
        (None, X),  # MCP defaults: openWorldHint=true
        ({"openWorldHint": False}, W),
        ({"openWorldHint": False, "readOnlyHint": True}, R),
        ({"openWorldHint": True, "readOnlyHint": True}, X),
        ({"openWorldHint": False, "destructiveHint": False, "idempotentHint": True}, W),
    ],
)
def test_mcp_annotations(annotations: dict[str, bool] | None, effect: Effect) -> None:
    spec = {"name": "t", "inputSchema": {"type": "object", "properties": {}}, "annotations": annotations}
    tool = Tool.from_mcp(spec, _noop)  # type: ignore[arg-type]
    assert tool.effect is effect
    assert tool.classify_call({}).cacheable is (effect is not X)


def test_normalize_fills_defaults_and_validates() -> None:
    tool = bash_tool()
    assert tool.normalize({"command": "ls"}) == {"command": "ls", "timeout": 120}
    assert tool.normalize({"command": "ls", "timeout": 5.0}) == {"command": "ls", "timeout": 5}
    with pytest.raises(InvalidArgument):
        tool.normalize({})
    with pytest.raises(InvalidArgument):
        tool.normalize({"command": 3})
    with pytest.raises(InvalidArgument):
        tool.normalize({"command": "ls", "bogus": 1})
    with pytest.raises(InvalidArgument):
        tool.normalize({"command": "ls", "timeout": True})


def test_normalize_validates_with_the_taps_validator() -> None:
    """One validator (``bunshin_async.tools.validate_schema``) decides for the tap and for ``normalize``."""
    from bunshin_async.tools import validate_schema

    schema = {"type": "object", "properties": {"m": {"enum": ["a", "b"]}, "n": {"type": "integer"}}}
    tool = Tool(name="t", schema=schema)
    assert validate_schema(schema, {"m": "c"}) is not None
    with pytest.raises(InvalidArgument, match=r"\$\.m should be one of"):
        tool.normalize({"m": "c"})
    assert tool.normalize({"m": "a", "n": 3.0}) == {"m": "a", "n": 3}  # 3.0 is a JSON integer, keyed as 3
