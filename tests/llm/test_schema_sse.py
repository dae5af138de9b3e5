from __future__ import annotations

import pytest

from bunshin_async._llm._sse import SSEDecoder
from bunshin_async.tools import validate_schema

from .conftest import BASH_SCHEMA, READ_SCHEMA

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("schema", "value", "error"),
    [
        (BASH_SCHEMA, {"command": "ls"}, None),
        (BASH_SCHEMA, {}, "lacks required property 'command'"),
        (BASH_SCHEMA, {"command": 3}, "$.command should be string"),
        (BASH_SCHEMA, [], "should be object"),
        (READ_SCHEMA, {"path": "a", "max_lines": 3}, None),
        (READ_SCHEMA, {"path": "a", "max_lines": 3.0}, None),
        (READ_SCHEMA, {"path": "a", "max_lines": 3.5}, "$.max_lines should be integer"),
        (READ_SCHEMA, {"path": "a", "max_lines": True}, "$.max_lines should be integer"),
        (READ_SCHEMA, {"path": "a", "x": 1}, "unexpected property 'x'"),
        ({"type": "object", "properties": {"m": {"enum": ["a", "b"]}}}, {"m": "c"}, "one of ['a', 'b']"),
        ({"type": "array", "items": {"type": "number"}}, [1, 2.5, "x"], "$[2] should be number"),
        ({"type": ["string", "null"]}, None, None),
        ({"type": "boolean"}, 1, "should be boolean"),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, 1.5, "matches none of anyOf"),
        ({"type": "string", "format": "uri", "minLength": 100}, "x", None),  # unsupported keywords accept
    ],
)
def test_validate(schema: dict, value: object, error: str | None) -> None:
    reason = validate_schema(schema, value)
    if error is None:
        assert reason is None
    else:
        assert reason is not None and error in reason


def test_sse_any_split() -> None:
    raw = b': comment\r\ndata: {"a":\r\ndata: 1}\r\n\r\nevent: error\ndata: x\n\ndata: \xc3\xa9\r\rdata: [DONE]\n\n'
    whole = SSEDecoder().feed(raw)
    assert [(e.event, e.data) for e in whole] == [
        ("message", '{"a":\n1}'),
        ("error", "x"),
        ("message", "é"),
        ("message", "[DONE]"),
    ]
    for size in (1, 2, 3, 7):
        decoder = SSEDecoder()
        events = []
        for i in range(0, len(raw), size):
            events += decoder.feed(raw[i : i + size])
        assert events == whole, size
