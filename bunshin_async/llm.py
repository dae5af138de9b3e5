"""Talking to model endpoints: a streaming chat-completions client, the tool-call tap (for our client and for
``openai`` streams) and the replay server (of the trajectory records in ``bunshin_async.rollout``).

The tap reports, as soon as each is knowable: a call's tool name (``ToolNameKnown``), each arguments fragment
(``ArgumentsDelta``), a call's arguments complete and schema-valid (``ArgumentsComplete``), the end of the message
(``MessageFinished``) and usage (``UsageReported``)::

    stream = await client.chat.completions.create(..., tools=tools, stream=True)
    async with tap_openai_stream(stream, tools) as tap:
        async for event in tap:
            if isinstance(event, ArgumentsComplete):
                start(event.call)          # before the message ends
    tap.chunks                             # the SDK's own chunks, unchanged

Replay: ``async with replay_server("trajectories.jsonl") as base_url:`` then use model
``replay:<task_id>:<rollout>`` (or the ``X-Replay-Trajectory`` header); see ``ReplayServer``.
"""

from __future__ import annotations

from ._llm._client import (
    ChatClient,
    ChatStream,
    Completion,
    RetryPolicy,
)
from ._llm._events import (
    ArgumentsComplete,
    ArgumentsDelta,
    MessageFinished,
    TapEvent,
    TextDelta,
    ToolCall,
    ToolNameKnown,
    Usage,
    UsageReported,
)
from ._llm._openai import (
    OpenAITap,
    tap_openai_stream,
    tee_openai_stream,
)
from ._llm._replay import ReplayServer, replay_server
from ._llm._tap import ToolCallTap, ToolsLike
from ._llm._timing import (
    FixedTiming,
    LognormalTiming,
    RecordedTiming,
    TimingModel,
)
from ._public import publish as _publish

__all__ = [
    "ArgumentsComplete",
    "ArgumentsDelta",
    "ChatClient",
    "ChatStream",
    "Completion",
    "FixedTiming",
    "LognormalTiming",
    "MessageFinished",
    "OpenAITap",
    "RecordedTiming",
    "ReplayServer",
    "RetryPolicy",
    "TapEvent",
    "TextDelta",
    "TimingModel",
    "ToolCall",
    "ToolCallTap",
    "ToolNameKnown",
    "ToolsLike",
    "Usage",
    "UsageReported",
    "replay_server",
    "tap_openai_stream",
    "tee_openai_stream",
]

_publish(__name__, globals())
