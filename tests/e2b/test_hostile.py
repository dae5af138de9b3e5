"""A hostile workspace against the E2B server: what a process inside leaves must not change what the server reports."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from e2b import Sandbox, SandboxException

from bunshin_async._e2b import _envd

from .conftest import Served


def test_a_precreated_control_directory_cannot_fake_a_later_commands_output(e2b_server: Served) -> None:
    # A process plants control directories for the next commands: their ``out`` an absolute symlink, which the
    # command's wrapper follows in the workspace while the server's confined file tool finds the planted file.
    plant = (
        "mkdir -p /run/e2b/tmp && printf 'FAKE\\n' > /run/e2b/tmp/x && "
        "for n in $(seq 0 20); do mkdir -p /run/e2b/p/$n && ln -sf /tmp/x /run/e2b/p/$n/out; done"
    )
    with Sandbox.create() as sbx:
        sbx.commands.run(plant)
        assert sbx.commands.run("echo real").stdout == "real\n"
        assert sbx.commands.run("echo again").stdout == "again\n"


def test_a_symlink_target_starting_with_a_newline_is_listed(e2b_server: Served) -> None:
    with Sandbox.create() as sbx:
        sbx.commands.run("mkdir -p /home/user/d && ln -s \"$(printf '\\nx')\" /home/user/d/l && touch /home/user/d/f")
        names = sorted(e.name for e in sbx.files.list("/home/user/d"))
        assert names == ["f", "l"]


def test_another_users_process_cannot_read_or_feed_a_commands_control_files(e2b_server: Served) -> None:
    with Sandbox.create() as sbx:
        secret = sbx.commands.run("echo root-secret; touch /tmp/said; sleep 60", background=True, stdin=True)
        # the secret is in its output file before the probe looks (else the probe could find nothing to leak)
        sbx.commands.run("until [ -e /tmp/said ]; do sleep 0.1; done", timeout=60)
        probe = "cat /run/e2b/p/*/out; ls /run/e2b/p | wc -l; for f in /run/e2b/p/*/in; do echo x > $f; done; true"
        out = sbx.commands.run(probe, user="nobody", timeout=10).stdout  # type: ignore[arg-type]
        assert "root-secret" not in out and out.split()[0] == "0"
        # A command of another user still gets its stdin (written as that user, into its own FIFO).
        cat = sbx.commands.run("head -n1", background=True, stdin=True, user="nobody")  # type: ignore[arg-type]
        sbx.commands.send_stdin(cat.pid, "hello\n")
        assert cat.wait().stdout == "hello\n"
        secret.kill()


def test_a_root_upload_into_another_users_directory_takes_no_mode_of_theirs(e2b_server: Served) -> None:
    # The directory's owner made the target set-user-id: what root uploads there keeps the permission bits only.
    with Sandbox.create() as sbx:
        sbx.commands.run("mkdir -p /home/att && chown nobody /home/att", user="root")
        sbx.commands.run("printf old > /home/att/tool && chmod 6755 /home/att/tool", user="nobody")  # type: ignore[arg-type]
        sbx.files.write("/home/att/tool", "#!/bin/sh\necho hi\n", user="root")
        assert sbx.commands.run("stat -c '%a %U' /home/att/tool; cat /home/att/tool", user="root").stdout == (
            "755 root\n#!/bin/sh\necho hi\n"
        )


def test_a_root_upload_whose_staged_file_another_user_swaps_writes_nothing_else(
    e2b_server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner of the directory a root upload goes to renames what the upload staged there and puts a symlink to a
    root-only file in its place, between the upload's first step and the next (the upload is held there: the race is
    won every time). The root file is neither written nor given another mode."""
    real_run = _envd._run
    swapped: list[str] = []

    async def run(ws: Any, script: str, *args: str, **kw: Any) -> Any:
        res = await real_run(ws, script, *args, **kw)
        if script == _envd._STAGE:
            swap = 'cd /home/att && for e in .bunshin-upload-*; do mv "$e" "moved$e" && ln -s /root/canary "$e"; done'
            swapped.append((await real_run(ws, swap, user="nobody")).stdout)
        return res

    monkeypatch.setattr(_envd, "_run", run)
    with Sandbox.create() as sbx:
        sbx.commands.run("mkdir -p /home/att && chown nobody /home/att", user="root")
        sbx.commands.run("printf secret > /root/canary && chmod 600 /root/canary", user="root")
        sbx.commands.run("printf old > /home/att/f && chmod 666 /home/att/f", user="nobody")  # type: ignore[arg-type]
        with pytest.raises(SandboxException, match="was replaced"):
            sbx.files.write("/home/att/f", "uploaded", user="root")
        assert swapped == [""]
        root = sbx.commands.run("stat -c '%a %U' /root/canary; cat /root/canary", user="root").stdout
        assert root == "600 root\nsecret"
        assert sbx.commands.run("cat /home/att/f", user="root").stdout == "old"


def test_a_command_that_swaps_its_output_for_a_fifo_does_not_hang_its_stream(e2b_server: Served) -> None:
    # Its control directory is its own: it may replace its output file by a FIFO nobody writes, which an open blocks on.
    swap = 'd=$(dirname "$(readlink /proc/$$/fd/1)"); rm "$d/out"; mkfifo "$d/out"; sleep 600'
    with Sandbox.create() as sbx:
        handle = sbx.commands.run(swap, background=True, timeout=60)
        with pytest.raises(SandboxException) as caught:
            handle.wait()
        assert "the stream of process" in str(caught.value)  # ended by the server's read bound, not the deadline
        assert sbx.commands.run("echo ok").stdout == "ok\n"


def test_invalid_environment_of_a_new_sandbox_is_a_client_error(e2b_server: Served) -> None:
    headers = {"X-API-KEY": e2b_server.server.api_key}
    with httpx.Client(base_url=e2b_server.server.url, headers=headers, timeout=60) as client:
        for env in ({"A=B": "c"}, {"A": "x\0y"}, {"": "x"}):
            answer = client.post("/sandboxes", json={"templateID": "base", "envVars": env})
            assert answer.status_code == 400, answer.text
        assert client.get("/v2/sandboxes").json() == []


def test_a_sandboxs_token_reaches_no_other_sandbox(e2b_server: Served) -> None:
    with Sandbox.create() as a, Sandbox.create() as b:
        with httpx.Client(base_url=e2b_server.server.url, timeout=60) as client:
            token = a._envd_access_token or ""
            assert client.get("/health", headers={"E2b-Sandbox-Id": a.sandbox_id, "X-Access-Token": token}).is_success
            as_b = {"E2b-Sandbox-Id": b.sandbox_id, "X-Access-Token": token}
            for method, path in (("GET", "/health"), ("GET", "/files?path=/etc/hostname"), ("POST", "/files")):
                assert client.request(method, path, headers=as_b).status_code == 401
            rpc = client.post("/filesystem.Filesystem/Stat", json={"path": "/"}, headers=as_b)
            assert rpc.status_code == 401
            stream = client.post(
                "/process.Process/Start",
                content=b"\0\0\0\0\2{}",
                headers={**as_b, "Content-Type": "application/connect+json"},
            )
            assert stream.status_code == 401
