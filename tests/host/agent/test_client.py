"""The host's bounds on agent answers (``_client.answer_limit``): pure logic, no workspace."""

from __future__ import annotations

import pytest

from bunshin_async._host import _protocol as P
from bunshin_async._host._client import CONTROL_FRAME, FILE_DATA_MAX, LISTING_MAX, answer_limit

pytestmark = pytest.mark.unit


def test_an_answer_is_bounded_by_what_its_request_can_return() -> None:
    assert answer_limit(P.ReadFile(path="x", max_bytes=10), 20) == CONTROL_FRAME + 20 + 10
    assert answer_limit(P.ReadFile(path="x"), 20) == CONTROL_FRAME + 20 + FILE_DATA_MAX
    assert answer_limit(P.ReadFile(path="x", max_bytes=1 << 40), 20) == CONTROL_FRAME + 20 + FILE_DATA_MAX
    assert answer_limit(P.ReadFile(path="x", max_bytes=-1), 20) == CONTROL_FRAME + 20
    # stdout and stderr, each up to max_output bytes, each byte up to 3 as UTF-8 with replacement
    assert answer_limit(P.Exec(argv=["x"], max_output=1000), 30) == CONTROL_FRAME + 30 + 6000
    assert answer_limit(P.ShellRun(shell_id=1, command="x", max_output=0), 30) == CONTROL_FRAME + 30
    assert answer_limit(P.ListDir(path="."), 10) == CONTROL_FRAME + 10 + LISTING_MAX
    assert answer_limit(P.Ping(), 10) == CONTROL_FRAME + 10
    assert answer_limit(P.WriteFile(path="x", data=b"y" * 100), 10) == CONTROL_FRAME + 10
