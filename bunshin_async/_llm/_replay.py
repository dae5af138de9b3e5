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

import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec

from .._rollout._trajectory import Fault, Trajectory, load_trajectories
from ._completions import render_completion
from ._http import HTTPRequest, Responder, serve_http
from ._responses import render_response, responses_decoder, responses_messages
from ._timing import FixedTiming, TimingModel, token_offsets
from ._turns import MatchMode, Rendered, ReplayError, Turn, build_turns, match_turn
from ._wire import (
    ChatMessage,
    ChatRequest,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
)

__all__ = ["ReplayServer", "build_turns", "replay_server"]

_request_decoder = msgspec.json.Decoder(ChatRequest)
_encoder = msgspec.json.Encoder()


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
        self._turns: dict[str, list[Turn]] = {}
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
                    raise ReplayError(405, "method_not_allowed", "use POST for /v1/chat/completions")
                await self._chat(request, responder, start)
            elif path == "/responses":
                if request.method != "POST":
                    raise ReplayError(405, "method_not_allowed", "use POST for /v1/responses")
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
                raise ReplayError(404, "not_found", f"no route {request.method} {request.path}")
        except ReplayError as exc:
            await self._error(responder, exc)

    async def _error(self, responder: Responder, exc: ReplayError, headers: Sequence[tuple[str, str]] = ()) -> None:
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
        raise ReplayError(
            404, "model_not_found",
            f"model {model!r} names no trajectory of this replay server ({len(self.trajectories)} loaded, e.g. "
            f"{examples}); use model 'replay:<task_id>:<rollout>' or the X-Replay-Trajectory header",
            "model",
        )  # fmt: skip

    async def _chat(self, request: HTTPRequest, responder: Responder, start: float) -> None:
        try:
            chat = _request_decoder.decode(request.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ReplayError(400, "invalid_body", f"the body is not a chat-completions request: {exc}") from None
        include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
        await self._serve(
            request, responder, start, chat.model, chat.messages, chat.stream,
            lambda key, turn: render_completion(
                chat, key, turn, self._text(turn), include_usage=include_usage, finish_flush=self.finish_flush
            ),
        )  # fmt: skip

    async def _responses(self, request: HTTPRequest, responder: Responder, start: float) -> None:
        try:
            body = responses_decoder.decode(request.body)
            messages = responses_messages(body)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise ReplayError(400, "invalid_body", f"the body is not a Responses API request: {exc}") from None
        await self._serve(
            request, responder, start, body.model, messages, body.stream,
            lambda key, turn: render_response(body.model, messages, key, turn, self._text(turn)),
        )  # fmt: skip

    async def _serve(
        self,
        request: HTTPRequest,
        responder: Responder,
        start: float,
        model: str,
        messages: list[ChatMessage],
        stream: bool,
        render: Callable[[str, Turn], Rendered],
    ) -> None:
        key = self._select(model, request.headers)
        turns = self._turns[key]
        turn = turns[match_turn(key, turns, messages, self.match, self.preamble)]
        fault = self._take_fault(key, turn)
        if fault in ("http_500", "http_503", "http_429"):
            status = int(fault[5:])
            retry = [("retry-after", "0")] if status == 429 else []
            await self._error(
                responder, ReplayError(status, "injected_fault", f"injected {status} (turn {turn.index})"), retry
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
        self, responder: Responder, rendered: Rendered, offsets: list[float], start: float, fault: Fault | None
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

    def _take_fault(self, key: str, turn: Turn) -> Fault | None:
        if turn.fault is None:
            return None
        served = self._faults_served.get((key, turn.index), 0)
        if turn.fault_times is not None and served >= turn.fault_times:
            return None
        self._faults_served[(key, turn.index)] = served + 1
        return turn.fault

    def _text(self, turn: Turn) -> str:
        return turn.text or (self.preamble or "" if turn.calls else "")


@asynccontextmanager
async def replay_server(
    trajectories: Iterable[Trajectory] | str | os.PathLike[str], **options: Any
) -> AsyncIterator[str]:
    """Run a ``ReplayServer`` on 127.0.0.1 and a free port for the block; yields its base URL
    (``http://127.0.0.1:PORT/v1``). ``options`` are ``ReplayServer``'s."""
    async with ReplayServer(trajectories, **options) as server:
        yield server.base_url
