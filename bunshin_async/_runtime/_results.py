"""What a turn gives back: each decided call's ``CallResult`` as soon as it is ready, the ``TurnOutcome`` at the
end."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .._llm._events import MessageFinished, ToolCall, Usage
from ._metrics import TurnMetrics

__all__ = ["CallResult", "TurnOutcome"]


class CallResult(msgspec.Struct, frozen=True, kw_only=True):
    """A decided call's outcome, yielded by ``SpeculativeTurn.feed`` as soon as it is ready (possibly before the
    message ends). ``error`` is the ``ToolError`` the tool raised (a result for the model, not a failure of the
    turn); ``source`` says whether a speculative branch produced it; ``seconds`` is the tool's own run time and
    ``t`` the ``time.monotonic()`` at which the result became available."""

    index: int
    call: ToolCall
    result: Any = None
    error: Any = None  # ToolError | None
    source: Literal["executed", "speculated"] = "executed"
    seconds: float = 0.0
    t: float = 0.0


class TurnOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """The finished turn: the model's message, the results of its calls in call order, usage and metrics."""

    message: MessageFinished
    results: list[CallResult]
    usage: Usage | None
    metrics: TurnMetrics
