"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: commands in on fd 3,
replies and events out on fd 4, each a JSON message ended by a NUL byte). No driver package: Debian's chromium
and the standard library are enough to load a page, collect what it logs and screenshot it."""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

# The flags that work on these machines (no sandbox as root, no GPU, and nothing that reaches for Google's hosts,
# whose connections the closed network refuses).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One browser with one page. ``open(url)`` loads it and returns what the page logged as errors."""

    def __init__(self, executable: str) -> None:
        self._profile = tempfile.mkdtemp(prefix="bunshin-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()

        def fds() -> None:  # the child reads commands on 3 and writes replies on 4 (via 100/101: either may be 3)
            os.dup2(cmd_r, 100)
            os.dup2(resp_w, 101)
            os.dup2(100, 3)
            os.dup2(101, 4)
            os.close(100)
            os.close(101)

        self._proc = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds,  # dup2 before exec; no other thread of the test process forks
            pass_fds=(3, 4),  # kept open by the close_fds that runs after preexec_fn
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(resp_w)
        self._next = 0
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=self.session)

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self._resp_r, 1 << 16):
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        box = self._replies.get(msg["id"])
                    if box is not None:
                        box.put(msg)
                else:
                    self.events.put(msg)

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        with self._lock:
            self._next += 1
            ident = self._next
            box: queue.Queue[dict[str, Any]] = queue.Queue()
            self._replies[ident] = box
        msg: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        reply = box.get(timeout=120)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    def open(self, url: str) -> list[str]:
        """Load ``url`` and return every error the page reported: console errors, uncaught exceptions and the
        browser's own error log (a resource that failed to load)."""
        while not self.events.empty():
            self.events.get_nowait()
        self.call("Page.navigate", {"url": url}, session=self.session)
        errors: list[str] = []
        loaded = False
        while not loaded:
            event = self.events.get(timeout=120)
            errors += self._error(event)
            loaded = event.get("method") == "Page.loadEventFired"
        # what the page's scripts log after the load event: wait until the document says it is complete and a
        # round trip through the page's own event loop has happened, then take the events that came before
        self.evaluate("new Promise(r => setTimeout(r, 0)).then(() => document.readyState)")
        while not self.events.empty():
            errors += self._error(self.events.get_nowait())
        return errors

    @staticmethod
    def _error(event: dict[str, Any]) -> list[str]:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            return ["console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])]
        if method == "Runtime.exceptionThrown":
            return ["exception: " + json.dumps(params.get("exceptionDetails", {}))[:500]]
        if method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            return [f"log: {entry.get('text')} {entry.get('url', '')}"]
        return []

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True}, self.session
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, self.session)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except Exception:  # already gone
            pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._cmd_w)
        self._reader.join(timeout=10)
        os.close(self._resp_r)
        shutil.rmtree(self._profile, ignore_errors=True)
