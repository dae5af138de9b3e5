"""The replay server: an OpenAI-compatible endpoint that answers with recorded trajectories, paced by a timing
model, so agent loops and rollout schedulers can be exercised without a GPU.

Routes: ``POST /v1/chat/completions`` (streamed or not, tool calls, ``stream_options.include_usage``),
``POST /v1/responses`` (the Responses API: ``input`` items, streamed events or the whole response),
``GET /v1/models``, ``GET /v1/models/{id}``.

Which trajectory a request replays: the ``X-Replay-Trajectory: <task_id>[:<rollout>]`` header if present, else the
model name ``replay:<task_id>[:<rollout>]`` (rollout defaults to 0), else the server's ``default_trajectory``.

Which turn: the request's assistant messages must repeat the recording's first turns; the next recorded turn is
served. ``match="skeleton"`` compares only tool names and arguments (tool observations and texts may differ, since
a replayed tool runs in a different workspace); ``match="exact"`` also compares assistant texts, tool-result ids and
any recorded ``observation``. A mismatch is a 400 (``code: replay_prefix_mismatch``) naming the first difference;
an unknown trajectory is a 404 (``model_not_found``). ``format_error`` steps of recorded traces (no usable tool call)
are skipped; a ``submit`` or tool-less step is the final turn (``finish_reason: "stop"``).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
import msgspec

from .._trajectory import Fault, Trajectory, load_trajectories
from ._http import HTTPRequest, Responder, serve_http
from ._timing import FixedTiming, LognormalTiming, RecordedTiming, TimingModel, token_offsets
from ._wire import (
    ChatChunk,
    ChatCompletion,
    ChatMessage,
    ChatRequest,
    ChunkChoice,
    CompletionChoice,
    Delta,
    ErrorBody,
    ErrorResponse,
    FunctionCall,
    FunctionDelta,
    ModelCard,
    ModelList,
    ToolCallDelta,
    WireToolCall,
    WireUsage,
    message_text,
)

__all__ = ["ReplayServer", "main", "replay_server"]

MatchMode = Literal["skeleton", "exact"]

_PIECE = re.compile(r"\s*\S{1,6}|\s+")
_request_decoder = msgspec.json.Decoder(ChatRequest)
_encoder = msgspec.json.Encoder()


class _Call(msgspec.Struct, frozen=True):
    name: str
    args: Any  # the parsed arguments, or None when the recording's raw_args is not JSON
    raw: str  # what is streamed
    observation: str | None


class _Turn(msgspec.Struct, frozen=True):
    index: int
    calls: list[_Call]
    text: str
    final: bool
    llm_seconds: float | None
    fault: Fault | None
    fault_times: int | None
    completion_tokens: int | None
    prompt_tokens: int | None


class _ReplayError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def _decode_args(raw: str) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


def build_turns(trajectory: Trajectory) -> list[_Turn]:
    """Group a trajectory's steps into assistant turns (see ``bunshin_async._trajectory``)."""
    turns: list[_Turn] = []
    group: int | None = None
    for step in trajectory.steps:
        if step.tool == "format_error" or step.kind == "format_error":
            continue
        if step.final:
            turns.append(
                _Turn(len(turns), [], step.assistant_text or "", True, step.llm_seconds, step.fault,
                      step.fault_times, step.completion_tokens, step.prompt_tokens)
            )  # fmt: skip
            break
        assert step.tool is not None
        raw = step.raw_args if step.raw_args is not None else _encoder.encode(step.args or {}).decode()
        call = _Call(step.tool, step.args if step.raw_args is None else _decode_args(raw), raw, step.observation)
        if turns and step.turn is not None and step.turn == group:
            last = turns[-1]
            seconds = (last.llm_seconds or 0.0) + (step.llm_seconds or 0.0)
            turns[-1] = msgspec.structs.replace(
                last, calls=[*last.calls, call], llm_seconds=seconds if last.llm_seconds is not None else None
            )
        else:
            turns.append(
                _Turn(len(turns), [call], step.assistant_text or "", False, step.llm_seconds, step.fault,
                      step.fault_times, step.completion_tokens, step.prompt_tokens)
            )  # fmt: skip
        group = step.turn
    return turns


def _describe(calls: Sequence[tuple[str, Any]]) -> str:
    if not calls:
        return "no tool call"
    return ", ".join(f"{name}({_encoder.encode(args).decode()[:120]})" for name, args in calls)


def match_turn(
    key: str, turns: list[_Turn], messages: list[ChatMessage], mode: MatchMode, preamble: str | None = None
) -> int:
    """Index of the recorded turn that answers ``messages``; raises ``_ReplayError`` naming the first mismatch."""
    assistants = [(i, m) for i, m in enumerate(messages) if m.role == "assistant"]
    for n, (pos, msg) in enumerate(assistants):
        if n >= len(turns) or turns[n].final:
            done = len(turns) if turns and turns[-1].final else len(turns)
            raise _ReplayError(
                400, "replay_past_end",
                f"trajectory {key} has {done} assistant turns and the last one ended the conversation; the request "
                f"already has {len(assistants)} assistant messages",
                "messages",
            )  # fmt: skip
        rec = turns[n]
        got = [
            (tc.function.name, _decode_args(tc.function.arguments) if tc.function.arguments.strip() else {})
            for tc in msg.tool_calls or ()
            if tc.function is not None
        ]
        want = [(c.name, c.args if c.args is not None else _decode_args(c.raw)) for c in rec.calls]
        if got != want:
            raise _ReplayError(
                400, "replay_prefix_mismatch",
                f"prefix mismatch with trajectory {key} at assistant turn {n} (messages[{pos}]): the request has "
                f"{_describe(got)}, the recording has {_describe(want)}",
                f"messages[{pos}]",
            )  # fmt: skip
        if mode == "exact":
            _match_exact(key, n, pos, rec, msg, messages, preamble)
    if len(assistants) >= len(turns):
        raise _ReplayError(
            400, "replay_past_end",
            f"trajectory {key} has only {len(turns)} assistant turns and the request already has {len(assistants)}; "
            "the recording has no final answer to serve",
            "messages",
        )  # fmt: skip
    return len(assistants)


def _match_exact(
    key: str, n: int, pos: int, rec: _Turn, msg: ChatMessage, messages: list[ChatMessage], preamble: str | None
) -> None:
    text = message_text(msg.content).strip()
    served = rec.text.strip() or (preamble or "").strip() if rec.calls else rec.text.strip()
    if text not in (rec.text.strip(), served):
        raise _ReplayError(
            400, "replay_prefix_mismatch",
            f"prefix mismatch with trajectory {key} at assistant turn {n} (messages[{pos}]): text {text[:80]!r} "
            f"differs from the recorded {rec.text.strip()[:80]!r}",
            f"messages[{pos}]",
        )  # fmt: skip
    ids = [tc.id for tc in msg.tool_calls or ()]
    results = {}
    for later in messages[pos + 1 :]:
        if later.role != "tool":
            break
        results[later.tool_call_id] = message_text(later.content)
    for call_id, call in zip(ids, rec.calls, strict=False):
        if call_id not in results:
            raise _ReplayError(
                400, "replay_prefix_mismatch",
                f"exact match with trajectory {key}: assistant turn {n} (messages[{pos}]) has no tool result for "
                f"call {call_id!r}",
                f"messages[{pos}]",
            )  # fmt: skip
        if call.observation is not None and results[call_id] != call.observation:
            raise _ReplayError(
                400, "replay_prefix_mismatch",
                f"exact match with trajectory {key}: the tool result of call {call_id!r} at turn {n} differs from "
                f"the recorded observation",
                f"messages[{pos}]",
            )  # fmt: skip


def _pieces(text: str) -> list[str]:
    return _PIECE.findall(text)


class _Rendered(msgspec.Struct):
    """A turn as SSE events: ``tokens[i]`` is sent at ``offsets[i]``; ``tail`` right after the last token;
    ``body`` is the whole answer of a request that does not stream."""

    tokens: list[bytes]
    tail: bytes
    body: bytes


class ResponsesRequest(msgspec.Struct):
    """What the replay server reads of a Responses API request (other fields are ignored)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False


_responses_decoder = msgspec.json.Decoder(ResponsesRequest)


def responses_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """A Responses API ``input`` as the chat messages it stands for: ``function_call`` items join the assistant
    message just before them (or start one), ``function_call_output`` items are tool messages."""
    out: list[ChatMessage] = []
    if body.instructions:
        out.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        return [*out, ChatMessage(role="user", content=body.input)]
    joinable = False  # the last message is an assistant message that calls may still join
    for item in body.input:
        kind = item.get("type", "message")
        if kind == "function_call":
            call = WireToolCall(str(item.get("call_id", "")), "function",
                                FunctionCall(str(item["name"]), str(item.get("arguments", ""))))  # fmt: skip
            if joinable:
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
            joinable = True
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append(ChatMessage(role="tool", tool_call_id=str(item.get("call_id", "")),
                                   content=output if isinstance(output, str | list) else str(output)))  # fmt: skip
            joinable = False
        elif kind == "message" and "role" in item:
            content = item.get("content")
            if isinstance(content, list):
                content = [{"text": p.get("text", "")} for p in content if isinstance(p, dict)]
            out.append(ChatMessage(role=str(item["role"]), content=content))
            joinable = item["role"] == "assistant"
        elif kind == "reasoning":
            continue
        else:
            raise ValueError(f"input item of type {kind!r} is not supported by the replay server")
    return out


class ReplayServer:
    """Serve ``trajectories`` (Trajectory records or a JSONL/.jsonl.gz path) on ``host:port`` (0: a free port).

    ``timing`` paces tokens (``time_scale`` multiplies every delay); ``match`` is ``"skeleton"`` or ``"exact"``;
    ``finish_flush`` sends the last arguments fragments in the same chunk as ``finish_reason`` (as some endpoints
    do); ``separate_finish`` sends the last argument fragment (a call's closing brace) in its own write and the
    finish event (``finish_reason``, usage, ``[DONE]``) one inter-token interval later, as real endpoints do (the
    stream tap can then start the last call before the message ends); ``preamble`` is assistant text streamed
    before the calls of turns whose recording has none (a model that says what it will do); ``stall_seconds`` is
    how long a ``stall`` fault keeps the connection silent before cutting it.
    Use as ``async with ReplayServer(...) as server:`` (``server.base_url``) or call ``serve()`` to run until
    cancelled.
    """

    def __init__(
        self,
        trajectories: Iterable[Trajectory] | str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timing: TimingModel | None = None,
        match: MatchMode = "skeleton",
        time_scale: float = 1.0,
        finish_flush: bool = False,
        separate_finish: bool = False,
        preamble: str | None = None,
        stall_seconds: float = 3600.0,
        default_trajectory: str | None = None,
    ) -> None:
        self._source = trajectories
        self.host = host
        self.port = port
        self.timing: TimingModel = timing or FixedTiming()
        self.match: MatchMode = match
        self.time_scale = time_scale
        self.finish_flush = finish_flush
        self.separate_finish = separate_finish
        self.preamble = preamble
        self.stall_seconds = stall_seconds
        self.default_trajectory = default_trajectory
        self.trajectories: dict[str, Trajectory] = {}
        self._turns: dict[str, list[_Turn]] = {}
        self._faults_served: dict[tuple[str, int], int] = {}
        self.requests = 0
        #: The worst lateness of a token against its schedule, in seconds (a measure of server overload).
        self.max_lag = 0.0
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``, what ``openai.AsyncOpenAI(base_url=...)`` wants."""
        return f"http://{self.host}:{self.port}/v1"

    async def load(self) -> None:
        source = self._source
        if isinstance(source, str | os.PathLike):
            loaded: Iterable[Trajectory] = await anyio.to_thread.run_sync(load_trajectories, source)
        else:
            loaded = source
        for trajectory in loaded:
            self.trajectories[trajectory.key] = trajectory
            self._turns[trajectory.key] = build_turns(trajectory)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load the trajectories and serve until cancelled; ``task_status`` gets the bound port."""
        if not self.trajectories:
            await self.load()
        async with anyio.create_task_group() as tg:
            self.port = await tg.start(lambda task_status: serve_http(
                self._handle, host=self.host, port=self.port, task_status=task_status))  # fmt: skip
            task_status.started(self.port)

    async def __aenter__(self) -> ReplayServer:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            await tg.start(self.serve)
        except BaseException as exc:
            await tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._tg = tg
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        # The body ran inside the server's task group: hand its exception to the group (which then raises it, with
        # a failure of the server's own tasks beside it), not None, which would hide both.
        tg, self._tg = self._tg, None
        if tg is None:
            return None
        tg.cancel_scope.cancel()
        return await tg.__aexit__(*exc_info)

    async def aclose(self) -> None:
        """Stop serving; open streams are cut. Idempotent."""
        await self.__aexit__(None, None, None)

    # ------------------------------------------------------------------------------------------------ routes

    async def _handle(self, request: HTTPRequest, responder: Responder) -> None:
        self.requests += 1
        start = anyio.current_time()
        path = request.path.rstrip("/")
        if path.startswith("/v1"):
            path = path[3:]
        try:
            if path == "/chat/completions":
                if request.method != "POST":
                    raise _ReplayError(405, "method_not_allowed", "use POST for /v1/chat/completions")
                await self._chat(request, responder, start)
            elif path == "/responses":
                if request.method != "POST":
                    raise _ReplayError(405, "method_not_allowed", "use POST for /v1/responses")
                await self._responses(request, responder, start)
            elif path == "/models" and request.method == "GET":
                cards = [ModelCard(id=f"replay:{key}") for key in self.trajectories]
                await responder.respond(200, _encoder.encode(ModelList(data=cards)))
            elif path.startswith("/models/") and request.method == "GET":
                key = self._select(path[len("/models/") :], {})
                await responder.respond(200, _encoder.encode(ModelCard(id=f"replay:{key}")))
            elif path in ("", "/health"):
                await responder.respond(200, b'{"status":"ok"}')
            else:
                raise _ReplayError(404, "not_found", f"no route {request.method} {request.path}")
        except _ReplayError as exc:
            await self._error(responder, exc)

    async def _error(self, responder: Responder, exc: _ReplayError, headers: Sequence[tuple[str, str]] = ()) -> None:
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        body = _encoder.encode(ErrorResponse(ErrorBody(exc.message, kind, exc.param, exc.code)))
        await responder.start(
            exc.status, [("content-type", "application/json"), ("content-length", str(len(body))), *headers]
        )
        await responder.send(body)
        await responder.end()

    def _select(self, model: str, headers: dict[str, str]) -> str:
        wanted = headers.get("x-replay-trajectory")
        if wanted is None and model.startswith("replay:"):
            wanted = model[len("replay:") :]
        if wanted is None:
            wanted = self.default_trajectory
        if wanted is not None:
            task, _, rollout = wanted.rpartition(":")
            key = wanted if task and rollout.isdigit() else f"{wanted}:0"
            if key in self.trajectories:
                return key
        examples = ", ".join(f"replay:{k}" for k in list(self.trajectories)[:3])
        raise _ReplayError(
            404, "model_not_found",
            f"model {model!r} names no trajectory of this replay server ({len(self.trajectories)} loaded, e.g. "
            f"{examples}); use model 'replay:<task_id>:<rollout>' or the X-Replay-Trajectory header",
            "model",
        )  # fmt: skip

    async def _chat(self, request: HTTPRequest, responder: Responder, start: float) -> None:
        try:
            chat = _request_decoder.decode(request.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _ReplayError(400, "invalid_body", f"the body is not a chat-completions request: {exc}") from None
        include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
        await self._serve(
            request, responder, start, chat.model, chat.messages, chat.stream,
            lambda key, turn: self._render(chat, key, turn, include_usage),
        )  # fmt: skip

    async def _responses(self, request: HTTPRequest, responder: Responder, start: float) -> None:
        try:
            body = _responses_decoder.decode(request.body)
            messages = responses_messages(body)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise _ReplayError(400, "invalid_body", f"the body is not a Responses API request: {exc}") from None
        await self._serve(
            request, responder, start, body.model, messages, body.stream,
            lambda key, turn: self._render_response(body.model, messages, key, turn),
        )  # fmt: skip

    async def _serve(
        self,
        request: HTTPRequest,
        responder: Responder,
        start: float,
        model: str,
        messages: list[ChatMessage],
        stream: bool,
        render: Callable[[str, _Turn], _Rendered],
    ) -> None:
        key = self._select(model, request.headers)
        turns = self._turns[key]
        turn = turns[match_turn(key, turns, messages, self.match, self.preamble)]
        fault = self._take_fault(key, turn)
        if fault in ("http_500", "http_503", "http_429"):
            status = int(fault[5:])
            retry = [("retry-after", "0")] if status == 429 else []
            await self._error(
                responder, _ReplayError(status, "injected_fault", f"injected {status} (turn {turn.index})"), retry
            )
            return
        if stream:  # headers first: the client's request returns while we render
            headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
            await responder.start(200, [*headers, ("x-replay-turn", str(turn.index))])
        rendered = render(key, turn)
        offsets = token_offsets(self.timing, len(rendered.tokens), turn.llm_seconds, f"{key}:{turn.index}")
        offsets = [o * self.time_scale for o in offsets]
        if not stream:
            await self._sleep_until(start + offsets[-1])
            if fault is not None:
                await self._fail_midway(responder, fault)
            await responder.respond(200, rendered.body)
            return
        await self._stream(responder, rendered, offsets, start, fault)

    async def _stream(
        self, responder: Responder, rendered: _Rendered, offsets: list[float], start: float, fault: Fault | None
    ) -> None:
        n = len(rendered.tokens)
        stop_at = n // 2 if fault is not None else n
        gap = (offsets[-1] - offsets[-2]) if n > 1 else 0.0
        i = 0
        while i < stop_at:
            await self._sleep_until(start + offsets[i])
            # Coalesce every token already due into one write, so a loaded host keeps the schedule (each stream
            # catches up) instead of drifting by one event-loop turn per token; with separate_finish the last
            # argument fragment (a call's closing brace) always gets its own write.
            now = anyio.current_time()
            self.max_lag = max(self.max_lag, now - start - offsets[i])
            j = i + 1
            limit = stop_at - 1 if self.separate_finish and i < stop_at - 1 else stop_at
            while j < limit and start + offsets[j] <= now:
                j += 1
            data = b"".join(rendered.tokens[i:j])
            if j == n and not self.separate_finish:
                data += rendered.tail
            await responder.send(data)
            i = j
        if fault is None and self.separate_finish:
            await self._sleep_until(start + offsets[-1] + gap)
            await responder.send(rendered.tail)
        if fault is not None:
            await self._fail_midway(responder, fault)
        await responder.end()

    async def _fail_midway(self, responder: Responder, fault: Fault) -> None:
        if fault == "stall":
            await anyio.sleep(self.stall_seconds)
        await responder.cut()

    @staticmethod
    async def _sleep_until(deadline: float) -> None:
        delay = deadline - anyio.current_time()
        if delay > 0:
            await anyio.sleep(delay)

    def _take_fault(self, key: str, turn: _Turn) -> Fault | None:
        if turn.fault is None:
            return None
        served = self._faults_served.get((key, turn.index), 0)
        if turn.fault_times is not None and served >= turn.fault_times:
            return None
        self._faults_served[(key, turn.index)] = served + 1
        return turn.fault

    def _text(self, turn: _Turn) -> str:
        return turn.text or (self.preamble or "" if turn.calls else "")

    def _render(self, chat: ChatRequest, key: str, turn: _Turn, include_usage: bool) -> _Rendered:
        cid = f"chatcmpl-replay-{key}-{turn.index}"
        created = int(time.time())

        def event(delta: Delta, finish: str | None = None) -> bytes:
            chunk = ChatChunk(id=cid, created=created, model=chat.model, choices=[ChunkChoice(0, delta, finish)])
            return b"data: " + _encoder.encode(chunk) + b"\n\n"

        deltas: list[Delta] = [Delta(content=p) for p in _pieces(self._text(turn))]
        ids = [f"call_{turn.index}_{i}" for i in range(len(turn.calls))]
        finish = "stop" if turn.final or not turn.calls else "tool_calls"
        finish_delta = Delta()
        for i, call in enumerate(turn.calls):
            deltas.append(Delta(tool_calls=[ToolCallDelta(i, ids[i], "function", FunctionDelta(call.name, ""))]))
            pieces = _pieces(call.raw)
            if self.finish_flush and i == len(turn.calls) - 1 and len(pieces) > 1:
                # Like some endpoints, send the rest of the last call's arguments with finish_reason.
                half = len(pieces) // 2
                pieces, rest = pieces[:half], "".join(pieces[half:])
                finish_delta = Delta(tool_calls=[ToolCallDelta(i, function=FunctionDelta(arguments=rest))])
            deltas += [Delta(tool_calls=[ToolCallDelta(i, function=FunctionDelta(arguments=p))]) for p in pieces]
        if not deltas:
            deltas.append(Delta(content=""))
        tokens = [event(d) for d in deltas]
        tokens[0] = event(Delta(role="assistant", content="")) + tokens[0]
        completion_tokens = turn.completion_tokens or len(deltas)
        prompt_chars = sum(len(message_text(m.content)) for m in chat.messages)
        prompt_tokens = turn.prompt_tokens or max(1, prompt_chars // 4)
        usage = WireUsage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
        tail_bytes = event(finish_delta, finish)
        if include_usage:
            usage_chunk = ChatChunk(id=cid, created=created, model=chat.model, choices=[], usage=usage)
            tail_bytes += b"data: " + _encoder.encode(usage_chunk) + b"\n\n"
        tail_bytes += b"data: [DONE]\n\n"
        message = ChatMessage(
            role="assistant",
            content=self._text(turn) or None,
            tool_calls=[WireToolCall(ids[i], "function", FunctionCall(c.name, c.raw)) for i, c in enumerate(turn.calls)]
            or None,
        )
        completion = ChatCompletion(cid, created, chat.model, [CompletionChoice(0, message, finish)], usage)
        return _Rendered(tokens, tail_bytes, _encoder.encode(completion))

    def _render_response(self, model: str, messages: list[ChatMessage], key: str, turn: _Turn) -> _Rendered:
        """The turn as Responses API events: a message item with the text (if any), then one function_call item
        per call, each streamed as argument deltas; ``response.completed`` (with usage) is the tail."""
        rid = f"resp_replay_{key}_{turn.index}".replace(":", "_")
        created = int(time.time())
        seq = iter(range(1, 1 << 30))

        def event(kind: str, **fields: Any) -> bytes:
            data = {"type": kind, "sequence_number": next(seq), **fields}
            return f"event: {kind}\ndata: ".encode() + _encoder.encode(data) + b"\n\n"

        def response(status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
            return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
                    "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                    "usage": usage}  # fmt: skip

        tokens: list[bytes] = []
        output: list[dict[str, Any]] = []
        head = event("response.created", response=response("in_progress", [], None))
        text = self._text(turn)
        if text:
            mid = f"msg_{rid}"
            item = {"id": mid, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            pre = event("response.output_item.added", output_index=0, item=item)
            pieces = _pieces(text)
            for i, piece in enumerate(pieces):
                tokens.append((pre if i == 0 else b"") + event(
                    "response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=piece,
                    logprobs=[]))  # fmt: skip
            part = {"type": "output_text", "text": text, "annotations": []}
            done = {**item, "status": "completed", "content": [part]}
            tokens[-1] += event(
                "response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text, logprobs=[]
            ) + event("response.output_item.done", output_index=0, item=done)
            output.append(done)
        for i, call in enumerate(turn.calls):
            index = len(output)
            fid = f"fc_{rid}_{i}"
            item = {"id": fid, "type": "function_call", "call_id": f"call_{turn.index}_{i}", "name": call.name,
                    "arguments": "", "status": "in_progress"}  # fmt: skip
            pre = event("response.output_item.added", output_index=index, item=item)
            pieces = _pieces(call.raw) or [""]
            for k, piece in enumerate(pieces):
                delta = event("response.function_call_arguments.delta", item_id=fid, output_index=index, delta=piece)
                tokens.append((pre if k == 0 else b"") + delta)
            done = {**item, "arguments": call.raw, "status": "completed"}
            tokens[-1] += event("response.function_call_arguments.done", item_id=fid, output_index=index,
                                name=call.name, arguments=call.raw) + event(
                "response.output_item.done", output_index=index, item=done)  # fmt: skip
            output.append(done)
        if not tokens:
            tokens.append(b"")
        tokens[0] = head + tokens[0]
        completion_tokens = turn.completion_tokens or len(tokens)
        prompt_chars = sum(len(message_text(m.content)) for m in messages)
        prompt_tokens = turn.prompt_tokens or max(1, prompt_chars // 4)
        usage = {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
        final = response("completed", output, usage)
        return _Rendered(tokens, event("response.completed", response=final), _encoder.encode(final))


@asynccontextmanager
async def replay_server(
    trajectories: Iterable[Trajectory] | str | os.PathLike[str], **options: Any
) -> AsyncIterator[str]:
    """Run a ``ReplayServer`` on 127.0.0.1 and a free port for the block; yields its base URL
    (``http://127.0.0.1:PORT/v1``). ``options`` are ``ReplayServer``'s."""
    async with ReplayServer(trajectories, **options) as server:
        yield server.base_url


# ---------------------------------------------------------------------------------------------------- CLI


def _timing_from_args(args: argparse.Namespace) -> TimingModel:
    fixed = FixedTiming(ttft=args.ttft, itl=args.itl)
    if args.time_model == "recorded":
        return RecordedTiming(ttft=args.ttft, fallback=fixed)
    if args.time_model == "lognormal":
        return LognormalTiming(ttft=args.ttft, itl=args.itl, sigma=args.sigma, seed=args.seed)
    return fixed


def main(argv: list[str] | None = None) -> int:
    """``bunshin replay-server``: serve a trajectory file until interrupted."""
    parser = argparse.ArgumentParser(
        prog="bunshin replay-server",
        description="Serve recorded trajectories as an OpenAI-compatible endpoint. Pick a trajectory with model "
        "'replay:<task_id>:<rollout>' or the X-Replay-Trajectory header.",
    )
    parser.add_argument("--trajectories", required=True, help="JSONL or .jsonl.gz trajectory file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--time-model", choices=["fixed", "recorded", "lognormal"], default="fixed")
    parser.add_argument("--ttft", type=float, default=0.2, help="time to first token, s (median for lognormal)")
    parser.add_argument("--itl", type=float, default=0.01, help="seconds per token (median for lognormal)")
    parser.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma")
    parser.add_argument("--seed", type=int, default=0, help="lognormal seed")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every delay (0 = no pacing)")
    parser.add_argument("--match", choices=["skeleton", "exact"], default="skeleton")
    parser.add_argument("--finish-flush", action="store_true", help="send last argument fragments with finish")
    parser.add_argument("--separate-finish", action="store_true", help="finish_reason in its own, later write")
    parser.add_argument("--preamble", help="assistant text streamed before the calls of turns recorded without")
    parser.add_argument("--default-trajectory", help="<task_id>:<rollout> served when the model names none")
    args = parser.parse_args(argv)
    server = ReplayServer(
        args.trajectories,
        host=args.host,
        port=args.port,
        timing=_timing_from_args(args),
        match=args.match,
        time_scale=args.time_scale,
        finish_flush=args.finish_flush,
        separate_finish=args.separate_finish,
        preamble=args.preamble,
        default_trajectory=args.default_trajectory,
    )

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            print(f"replay server on {server.base_url} serving {len(server.trajectories)} trajectories", flush=True)

    try:
        anyio.run(run)
    except KeyboardInterrupt:
        pass
    return 0
