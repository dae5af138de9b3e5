"""Adapters that tap an ``openai.AsyncOpenAI`` stream the caller already has, without changing how it is made.

``openai`` is an optional dependency: nothing here imports it at module load.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from types import TracebackType
from typing import Any

import anyio
import httpx

from .._exceptions import LLMStreamError
from ._events import TapEvent
from ._tap import ResponsesState, ToolCallTap, ToolsLike, feed_chat_chunk, feed_response_event

__all__ = ["OpenAITap", "tap_openai_stream", "tee_openai_stream"]


def _is_transport_error(exc: BaseException) -> bool:
    if isinstance(exc, httpx.HTTPError):
        return True
    try:
        import openai
    except ImportError:  # pragma: no cover - the stream came from somewhere
        return False
    return isinstance(exc, openai.APIError)


async def _close(stream: Any) -> None:
    close = getattr(stream, "close", None) or getattr(stream, "aclose", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result


class OpenAITap:
    """``async for event in tap`` yields ``TapEvent``s; every raw chunk (or Responses event) stays available in
    ``chunks`` (unless ``keep_chunks=False``) and ``tap.tap`` holds the state (``content``, partial arguments).

    The underlying stream is closed when the message ends, on any error, and by ``aclose()``/``async with`` (use it
    when you may stop early). Transport failures mid-stream become ``LLMStreamError``.
    """

    def __init__(self, stream: AsyncIterable[Any], tools: ToolsLike, *, keep_chunks: bool = True) -> None:
        self.stream = stream
        self.tap = ToolCallTap(tools)
        self.chunks: list[Any] = []
        self._keep = keep_chunks
        self._iter = stream.__aiter__()
        self._pending: deque[TapEvent] = deque()
        self._responses = ResponsesState()
        self._done = False

    def feed(self, item: Any) -> list[TapEvent]:
        """Process one raw chunk or Responses event (exposed for ``tee_openai_stream``)."""
        if self._keep:
            self.chunks.append(item)
        if hasattr(item, "choices"):
            return feed_chat_chunk(self.tap, item)
        return feed_response_event(self.tap, self._responses, item)

    def __aiter__(self) -> OpenAITap:
        return self

    async def __anext__(self) -> TapEvent:
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            item = await self._next_item()
            if item is None:
                self._done = True
                await self.aclose()
                self._pending.extend(self.tap.end())
                continue
            try:
                self._pending.extend(self.feed(item))
            except BaseException:
                await self.aclose()
                raise
        return self._pending.popleft()

    async def _next_item(self) -> Any:
        try:
            return await self._iter.__anext__()
        except StopAsyncIteration:
            return None
        except Exception as exc:
            await self.aclose()
            if _is_transport_error(exc):
                raise LLMStreamError(f"the stream failed mid-message: {exc!r}") from exc
            raise
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Close the underlying stream (idempotent; shielded so that it also runs while being cancelled)."""
        self._done = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await _close(self.stream)

    async def __aenter__(self) -> OpenAITap:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def tap_openai_stream(stream: AsyncIterable[Any], tools: ToolsLike, *, keep_chunks: bool = True) -> OpenAITap:
    """Tap ``await client.chat.completions.create(..., stream=True)`` or ``await client.responses.create(...,
    stream=True)``: iterate the result for ``TapEvent``s; the raw chunks stay in ``.chunks``."""
    return OpenAITap(stream, tools, keep_chunks=keep_chunks)


async def tee_openai_stream(
    stream: AsyncIterable[Any], tools: ToolsLike, on_event: Callable[[TapEvent], object]
) -> AsyncIterator[Any]:
    """Yield the stream's chunks unchanged (the caller's loop stays as it was) and call ``on_event`` for every
    ``TapEvent`` before the chunk that caused it is yielded. Close the generator (``aclose``) if you stop early."""
    tapped = OpenAITap(stream, tools, keep_chunks=False)
    try:
        while True:
            item = await tapped._next_item()
            if item is None:
                for event in tapped.tap.end():
                    on_event(event)
                return
            for event in tapped.feed(item):
                on_event(event)
            yield item
    finally:
        await tapped.aclose()
