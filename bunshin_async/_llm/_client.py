"""``ChatClient``: a streaming chat-completions client on httpx, with the tool-call tap built in.

Retries (429, 5xx, 408, connection failures) happen only before the response body starts: once events have been
handed to the caller, a failure is an ``LLMStreamError``, never a silent replay.
"""

from __future__ import annotations

import os
import random
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import httpx
import msgspec

from .._exceptions import LLMConnectionError, LLMHTTPError, LLMStreamError, UsageError
from ._events import MessageFinished, TapEvent, ToolCall, Usage
from ._sse import SSEDecoder
from ._tap import ToolCallTap, ToolsLike, feed_chat_chunk
from ._wire import ChatChunk, ErrorResponse

__all__ = ["ChatClient", "ChatStream", "Completion", "RetryPolicy"]

DEFAULT_TIMEOUT = httpx.Timeout(120.0, connect=10.0)

_chunk_decoder = msgspec.json.Decoder(ChatChunk)
_error_decoder = msgspec.json.Decoder(ErrorResponse)


class RetryPolicy(msgspec.Struct, frozen=True):
    """Exponential backoff with jitter: attempt ``n`` (from 0) waits ``min(backoff * 2**n, max_backoff)`` seconds,
    times a random factor in ``[1 - jitter, 1]``. A ``Retry-After`` header (seconds) wins, capped at
    ``max_retry_after``."""

    max_retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 8.0
    jitter: float = 0.25
    max_retry_after: float = 60.0
    statuses: frozenset[int] = frozenset({408, 409, 429, 500, 502, 503, 504})

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        if retry_after:
            try:
                return min(max(float(retry_after), 0.0), self.max_retry_after)
            except ValueError:
                pass  # an HTTP date: fall back to our own backoff
        base = min(self.backoff * 2**attempt, self.max_backoff)
        return float(base * (1.0 - self.jitter * random.random()))


class Completion(msgspec.Struct, frozen=True):
    """A whole assistant message."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    usage: Usage | None = None


def _error_message(body: bytes) -> str:
    try:
        return _error_decoder.decode(body).error.message
    except (msgspec.DecodeError, msgspec.ValidationError):
        return body[:500].decode("utf-8", "replace")


class ChatStream:
    """One streamed chat completion. ``async with client.stream(...) as s: async for event in s: ...``.

    Entering sends the request (with retries) and returns once the endpoint accepted it; iterating yields
    ``TapEvent``s. Leaving (also on cancellation) closes the connection. ``tap`` holds the state, ``finished`` the
    ``MessageFinished`` event once seen.
    """

    def __init__(self, client: ChatClient, body: bytes, tools: ToolsLike) -> None:
        self._client = client
        self._body = body
        self.tap = ToolCallTap(tools)
        self._response: httpx.Response | None = None
        self._bytes: Any = None
        self._sse = SSEDecoder()
        self._pending: deque[TapEvent] = deque()
        self._done = False

    @property
    def finished(self) -> MessageFinished | None:
        return self.tap.finished

    async def __aenter__(self) -> ChatStream:
        self._response = await self._client._send(self._body)
        self._bytes = self._response.aiter_bytes()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (idempotent, shielded)."""
        self._done = True
        if self._response is not None:
            response, self._response = self._response, None
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await response.aclose()

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> TapEvent:
        if self._bytes is None:
            raise UsageError("use `async with client.stream(...) as stream` before iterating", what="ChatStream")
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            try:
                data = await self._bytes.__anext__()
            except StopAsyncIteration:
                self._done = True
                self._pending.extend(self.tap.end())
                continue
            except httpx.TimeoutException as exc:
                raise LLMStreamError(f"the stream stalled: no data within the read timeout ({exc!r})") from exc
            except httpx.HTTPError as exc:
                raise LLMStreamError(f"the stream was cut mid-message: {exc!r}") from exc
            for sse in self._sse.feed(data):
                if sse.data.strip() == "[DONE]":
                    self._done = True
                    self._pending.extend(self.tap.end())
                    break
                self._pending.extend(self._feed(sse.data))
        return self._pending.popleft()

    def _feed(self, data: str) -> list[TapEvent]:
        try:
            chunk = _chunk_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LLMStreamError(f"malformed chunk in the stream: {exc}; got {data[:200]!r}") from None
        if not chunk.choices and chunk.usage is None and '"error"' in data:
            raise LLMStreamError(f"the endpoint reported an error mid-stream: {_error_message(data.encode())}")
        return feed_chat_chunk(self.tap, chunk)


class ChatClient:
    """A chat-completions client for any OpenAI-compatible endpoint.

    ``base_url`` and ``api_key`` default to ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``. ``timeout`` is httpx's: its
    read timeout bounds the silence between two stream reads, so a stalled stream fails instead of hanging. Pass
    ``http`` to share a connection pool; it is then yours to close.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        headers: Mapping[str, str] | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        base = base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        self.url = base.rstrip("/") + "/chat/completions"
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.retry = retry or RetryPolicy()
        self._headers = {"content-type": "application/json", "accept": "text/event-stream", **(headers or {})}
        if key:
            self._headers["authorization"] = f"Bearer {key}"
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(
            timeout=timeout, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        )

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_http and not self._http.is_closed:
            with anyio.CancelScope(shield=True):
                await self._http.aclose()

    def stream(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any] | msgspec.Struct],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tap_tools: ToolsLike | None = None,
        include_usage: bool = True,
        **params: Any,
    ) -> ChatStream:
        """Start a streamed completion (use with ``async with``). ``tools`` is sent as is; the tap validates calls
        against it, or against ``tap_tools`` if given. Other ``params`` (``temperature``, ...) go into the body."""
        body: dict[str, Any] = {"model": model, "messages": list(messages), "stream": True, **params}
        if tools:
            body["tools"] = list(tools)
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        return ChatStream(self, msgspec.json.encode(body), tap_tools if tap_tools is not None else (tools or ()))

    async def complete(self, **kwargs: Any) -> Completion:
        """Stream a completion to its end and return it whole (same arguments as ``stream``)."""
        async with self.stream(**kwargs) as stream:
            async for _ in stream:
                pass
        finished = stream.finished
        assert finished is not None  # the tap raised otherwise
        return Completion(
            content=finished.content,
            tool_calls=finished.tool_calls,
            finish_reason=finished.finish_reason,
            usage=stream.tap.usage,
        )

    async def _send(self, body: bytes) -> httpx.Response:
        attempt = 0
        while True:
            try:
                request = self._http.build_request("POST", self.url, content=body, headers=self._headers)
                response = await self._http.send(request, stream=True)
            except httpx.TransportError as exc:
                if attempt >= self.retry.max_retries:
                    raise LLMConnectionError(
                        f"cannot reach {self.url} after {attempt + 1} attempts: {exc!r}; check the URL and that "
                        "the server runs"
                    ) from exc
                await anyio.sleep(self.retry.delay(attempt))
                attempt += 1
                continue
            if response.status_code < 400:
                return response
            try:
                raw = await response.aread()
            finally:
                await response.aclose()
            if response.status_code in self.retry.statuses and attempt < self.retry.max_retries:
                await anyio.sleep(self.retry.delay(attempt, response.headers.get("retry-after")))
                attempt += 1
                continue
            raise LLMHTTPError(
                f"{self.url} answered {response.status_code}: {_error_message(raw)}",
                status=response.status_code,
                body=raw.decode("utf-8", "replace"),
            )
