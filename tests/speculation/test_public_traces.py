"""What the speculator learns from the public traces (``tests/_traces``): host tests, since the traces sit beside the
project's checkout and are no part of a clone."""

from __future__ import annotations

from speculator import default_ngram, train_ngram
from tests._traces import SHARED_TRACE


def test_history_trained_on_public_traces() -> None:
    model = train_ngram(SHARED_TRACE, limit=100)
    assert model.next_signatures(["bash:cat >"])[0][0] == "bash:python script"


def test_the_bundled_table_is_what_the_public_traces_teach() -> None:
    bundled = default_ngram()
    trained = train_ngram(SHARED_TRACE)
    for history in (["bash:cat >"], ["bash:ls", "bash:grep"], []):
        assert [s for s, _ in bundled.next_signatures(history, top=3)] == [
            s for s, _ in trained.next_signatures(history, top=3)
        ]
    assert bundled.repeat_probability("bash:python script") == trained.repeat_probability("bash:python script")
