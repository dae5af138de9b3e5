"""An incremental server-sent-events decoder (WHATWG HTML, "Interpreting an event stream"): lines end in CRLF, LF
or CR, ``data:`` lines of one event join with LF, a blank line dispatches, ``:`` starts a comment."""

from __future__ import annotations

import msgspec

__all__ = ["SSEDecoder", "ServerSentEvent"]


class ServerSentEvent(msgspec.Struct, frozen=True):
    """One server-sent event (``SSEDecoder``): its ``data`` lines joined, ``event`` and ``id``."""

    data: str
    event: str = "message"
    id: str | None = None


class SSEDecoder:
    """Feed bytes as they arrive; get back the events they completed. Splits anywhere (mid-line, mid-UTF-8,
    between CR and LF) are fine."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CRLF split across two reads
        self._pending_cr = False
        self._buf += chunk
        events: list[ServerSentEvent] = []
        while True:
            lf, cr = self._buf.find(b"\n"), self._buf.find(b"\r")
            cut = min(lf, cr) if lf >= 0 and cr >= 0 else max(lf, cr)
            if cut < 0:
                return events
            line = self._buf[:cut]
            rest = self._buf[cut + 1 :]
            if self._buf[cut] == 13:
                if rest.startswith(b"\n"):
                    rest = rest[1:]
                elif not rest:
                    self._pending_cr = True
            self._buf = rest
            event = self._line(line.decode("utf-8", "replace"))
            if event is not None:
                events.append(event)

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = ServerSentEvent(data="\n".join(self._data), event=self._event or "message", id=self._id)
            self._data, self._event = [], ""
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None
