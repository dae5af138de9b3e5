"""The observation predictor's odds: the rollout's latest form, its older ones, and the group's."""

from __future__ import annotations

import pytest

from bunshin_async.speculation import CallKey, PredictionContext
from bunshin_async.tools import bash_tool
from speculator import ObservationPredictor, SiblingTable

pytestmark = pytest.mark.unit

BASH = bash_tool()
ERROR = "Traceback ...\nModuleNotFoundError: No module named '{}'\n"


def _ctx(output: str) -> PredictionContext:
    return PredictionContext(history=(), chain=b"", turn=1, position=0, last_output=output)


def _guesses(predictor: ObservationPredictor, module: str) -> list[tuple[str, float]]:
    return [(c.arguments["command"], round(c.probability, 3)) for c in predictor.predict(_ctx(ERROR.format(module)))]


def test_the_latest_own_form_at_half_an_older_one_at_a_tenth_of_that() -> None:
    table = SiblingTable()
    mine = ObservationPredictor(table)
    mine.observe(_ctx(ERROR.format("numpy")), CallKey.of(BASH, {"command": "pip install numpy"}))
    mine.observe(_ctx(ERROR.format("pandas")), CallKey.of(BASH, {"command": "pip install pandas --no-deps"}))
    # the group's forms (this rollout's included) each a half share: 0.7 x (1/2)^2; the own latest 0.5, older 0.05
    assert _guesses(mine, "scipy") == [("pip install scipy --no-deps", 0.5), ("pip install scipy", 0.175)]
    # a rollout that used no form yet: the group's, by share
    assert _guesses(ObservationPredictor(table), "scipy") == [
        ("pip install scipy", 0.175),
        ("pip install scipy --no-deps", 0.175),
    ]
    # a form the whole group used: 0.7
    whole = ObservationPredictor(SiblingTable())
    whole.observe(_ctx(ERROR.format("numpy")), CallKey.of(BASH, {"command": "pip install numpy"}))
    assert _guesses(ObservationPredictor(whole.table), "scipy") == [("pip install scipy", 0.7)]
    older = ObservationPredictor(SiblingTable(), siblings=0.0)
    older.observe(_ctx(ERROR.format("numpy")), CallKey.of(BASH, {"command": "pip install numpy"}))
    older.observe(_ctx(ERROR.format("pandas")), CallKey.of(BASH, {"command": "pip3 install pandas"}))
    assert _guesses(older, "scipy") == [("pip3 install scipy", 0.5), ("pip install scipy", 0.05)]
