"""What a client may make the server hold or do: template ids that are not image references, uploads (streamed
into the workspace in bounded pieces), open streams (capped per sandbox and per server); and E2B's user owning
its home where the image has that user."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import e2b
import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, SandboxException
from e2b.sandbox.filesystem.filesystem import WriteEntry

from bunshin_async._e2b import _envd, _rpc
from bunshin_async._e2b._app import E2BApp

from .conftest import Served

pytestmark = pytest.mark.root


def test_a_template_id_that_is_no_image_reference_is_refused(e2b_server: Served) -> None:
    headers = {"X-API-KEY": e2b_server.server.api_key}
    with httpx.Client(base_url=e2b_server.server.url, headers=headers, timeout=60) as client:
        for template in ("../containers/json", "images/x/json?a=1", "UPPER", "a b", "x" * 600):
            answer = client.post("/sandboxes", json={"templateID": template})
            assert answer.status_code == 400, answer.text
            assert "not a snapshot or template of this server nor an image reference" in answer.json()["message"]
            # the default template's image named by metadata goes through the same check
            answer = client.post("/sandboxes", json={"templateID": "base", "metadata": {"image": template}})
            assert answer.status_code == 400, answer.text
        assert client.post("/sandboxes", json={"templateID": "no-such-image:1"}).status_code == 404
        assert client.get("/v2/sandboxes").json() == []
    with pytest.raises(SandboxException, match="image reference"):
        Sandbox.create("../containers/json")


def test_uploads_reach_the_workspace_in_bounded_pieces(e2b_server: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_envd, "UPLOAD_CHUNK", 256 << 10)
    pieces: list[int] = []
    real_run = _envd._run

    async def counting_run(ws: Any, script: str, *args: str, stdin: bytes | None = None, **kw: Any) -> Any:
        if stdin is not None:
            pieces.append(len(stdin))
        return await real_run(ws, script, *args, stdin=stdin, **kw)

    monkeypatch.setattr(_envd, "_run", counting_run)
    blob = os.urandom(3 << 20)
    with Sandbox.create() as sbx:
        sbx.files.write("/tmp/stream.bin", io.BytesIO(blob))  # octet-stream: the body as it arrives
        # As it arrives: how the body's reads group depends on the network and the load, so only their bound and
        # their sum are fixed (a piece is at most a chunk plus one read of the body).
        assert sum(pieces) == len(blob) and len(pieces) >= 3 and max(pieces) <= (256 << 10) + (1 << 20), pieces
        pieces.clear()
        sbx.files.write("/tmp/form.bin", blob, use_octet_stream=False)  # multipart: the file part in pieces
        assert len(pieces) == 12 and max(pieces) == 256 << 10, pieces
        for path in ("/tmp/stream.bin", "/tmp/form.bin"):
            assert sbx.commands.run(f"sha256sum {path}").stdout.split()[0] == hashlib.sha256(blob).hexdigest()
        sbx.files.write("/tmp/stream.bin", b"short")  # a later write replaces, not appends
        assert sbx.files.read("/tmp/stream.bin") == "short"
        sbx.files.write("/tmp/empty", io.BytesIO(b""))
        assert sbx.files.get_info("/tmp/empty").size == 0


def _chunks(n: int, size: int = 64 << 10) -> Iterator[bytes]:
    """An iterable body: the SDK sends it chunked, declaring no length (the server counts as it reads)."""
    for _ in range(n):
        yield b"x" * size


def _state(sbx: Sandbox, directory: str) -> str:
    return sbx.commands.run(f"ls -A {directory}; cat {directory}/kept.txt").stdout


def test_an_upload_past_the_limit_or_failing_writes_no_file(
    e2b_server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_envd, "UPLOAD_CHUNK", 256 << 10)
    monkeypatch.setattr(_envd, "MAX_UPLOAD", 1 << 20)
    with Sandbox.create() as sbx:
        sbx.files.write("/tmp/up/kept.txt", "old")
        # 2 MiB against a 1 MiB limit: refused once past it, when four pieces have reached the workspace
        with pytest.raises(SandboxException, match="too large"):
            sbx.files.write("/tmp/up/kept.txt", _chunks(32))
        with pytest.raises(SandboxException, match="too large"):
            sbx.files.write("/tmp/up/new/deeper/big.bin", _chunks(32))
        assert _state(sbx, "/tmp/up") == "kept.txt\nold"  # the old file whole; no new file, directory or piece
        # several files in one request, the last of which cannot be written (a directory has its name): none is
        sbx.commands.run("mkdir /tmp/up/dir")
        with pytest.raises(SandboxException, match="is a directory"):
            files = [WriteEntry(path="/tmp/up/kept.txt", data="new"), WriteEntry(path="/tmp/up/dir", data="x")]
            sbx.files.write_files(files)
        assert _state(sbx, "/tmp/up") == "dir\nkept.txt\nold"
        # within the limit: the file is replaced whole, keeping its mode
        sbx.commands.run("chmod 600 /tmp/up/kept.txt")
        sbx.files.write("/tmp/up/kept.txt", _chunks(12))
        after = sbx.commands.run("stat -c '%s %a' /tmp/up/kept.txt; ls -A /tmp/up").stdout
        assert after == "786432 600\ndir\nkept.txt\n"


def test_an_upload_its_client_abandons_writes_no_file(e2b_server: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_envd, "UPLOAD_CHUNK", 256 << 10)
    wrote = threading.Event()
    real_run = _envd._run

    async def run(ws: Any, script: str, *args: str, stdin: bytes | None = None, **kw: Any) -> Any:
        res = await real_run(ws, script, *args, stdin=stdin, **kw)
        if stdin:
            wrote.set()
        return res

    monkeypatch.setattr(_envd, "_run", run)

    class Abandoned(Exception):
        pass

    def body() -> Iterator[bytes]:
        yield b"x" * (300 << 10)  # past a piece: the server writes it to the workspace
        assert wrote.wait(60)
        raise Abandoned  # the client gives up mid-body: the SDK cuts the connection

    with Sandbox.create() as sbx:
        sbx.files.write("/tmp/cut/kept.txt", "old")
        with pytest.raises((Abandoned, httpx.TransportError, SandboxException)):  # as the SDK reports it
            sbx.files.write("/tmp/cut/kept.txt", body())
        # The server undoes it when it sees the client gone, on its own time: what is asserted is the state it
        # reaches (the bound only ends a failing test).
        for _ in range(300):
            if _state(sbx, "/tmp/cut") == "kept.txt\nold":
                break
            time.sleep(0.2)
        assert _state(sbx, "/tmp/cut") == "kept.txt\nold"


async def test_open_streams_are_capped_per_sandbox_and_per_server(e2b_server: Served) -> None:
    sandboxes = e2b_server.server.sandboxes
    sandboxes.max_listeners, sandboxes.max_listeners_total = 2, 3
    a, b = await AsyncSandbox.create(), await AsyncSandbox.create()
    try:
        held = [await a.commands.run("cat", background=True, stdin=True, timeout=0) for _ in range(2)]
        with pytest.raises(SandboxException, match="streams open"):
            await a.commands.run("touch /tmp/ran", background=True)
        assert not await a.files.exists("/tmp/ran")  # refused before it started
        with pytest.raises(SandboxException, match="streams open"):
            await a.files.watch_dir("/tmp", on_event=lambda e: None)
        held.append(await b.commands.run("sleep 60", background=True, timeout=0))  # the server's third
        with pytest.raises(SandboxException, match="streams open"):
            await b.commands.run("true")
        await held[0].disconnect()  # the server sees the cut at once (test_a_stream_its_client_leaves_...)
        with anyio.fail_after(30):
            while sandboxes.listeners >= 3:  # noqa: ASYNC110 - a counter of the server's thread
                await anyio.sleep(0.05)
        assert (await a.commands.run("echo again")).stdout == "again\n"
        watch = await a.files.watch_dir("/tmp", on_event=lambda e: None)
        await watch.stop()
        for h in held:
            await h.kill()
    finally:
        await a.kill()
        await b.kill()
    with anyio.fail_after(30):
        while sandboxes.listeners:
            await anyio.sleep(0.1)


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
async def test_a_stream_its_client_leaves_frees_its_slot_without_writing(
    e2b_server: Served, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    """A command's stream and a directory watch whose client goes away free their slots (and the command's pump
    stops) as soon as the server sees the connection cut, not when it next writes (a keepalive, 50 s apart), under
    either ASGI spec version uvicorn may announce (starlette listens for the disconnect itself only below 2.4)."""
    real_app = E2BApp.__call__

    async def app(self: E2BApp, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": spec}}
        await real_app(self, scope, receive, send)

    monkeypatch.setattr(E2BApp, "__call__", app)
    frames = [0]
    real_envelope = _rpc.envelope

    def envelope(payload: bytes, flags: int = 0) -> bytes:
        frames[0] += 1
        return real_envelope(payload, flags)

    monkeypatch.setattr(_rpc, "envelope", envelope)
    sandboxes = e2b_server.server.sandboxes
    sbx = await AsyncSandbox.create()
    try:
        cmd = await sbx.commands.run("cat", background=True, stdin=True, timeout=0)
        watch = await sbx.files.watch_dir("/home/user", on_event=lambda e: None)
        proc = sandboxes.get(sbx.sandbox_id).processes[cmd.pid]
        assert sandboxes.listeners == 2 and proc.pumping
        written = frames[0]
        await cmd.disconnect()
        await watch.stop()
        with anyio.fail_after(120):  # bounds a failure only: what is asserted is the count, and how it got there
            while sandboxes.listeners or proc.pumping:  # noqa: ASYNC110 - state of the server's thread
                await anyio.sleep(0.05)
        assert frames[0] == written  # no frame (keepalive or data) was written to find the client gone
        await sbx.commands.kill(cmd.pid)
    finally:
        await sbx.kill()


async def test_e2bs_user_owns_its_home_where_the_image_has_it(e2b_server: Served) -> None:
    # and an image whose /etc/passwd does not list root (the home is chowned as uid 0, by number)
    steps = "useradd -M -s /bin/bash user && sed -i '/^root:/d' /etc/passwd"
    template = e2b.Template().from_template("base").run_cmd(steps)
    await e2b.AsyncTemplate.build(template, "with-user")
    sbx = await e2b.AsyncSandbox.create("with-user")
    try:
        assert (await sbx.commands.run("stat -c %U /home/user")).stdout == "user\n"
        await sbx.commands.run("echo mine > ~/f && stat -c %U ~/f", user="user")
        assert (await sbx.files.read("/home/user/f", user="user")) == "mine\n"
    finally:
        await sbx.kill()
    base = await e2b.AsyncSandbox.create()  # no user `user` in the base image: root's home, commands as root
    try:
        assert (await base.commands.run("stat -c %U /home/user; id -un")).stdout == "root\nroot\n"
    finally:
        await base.kill()
