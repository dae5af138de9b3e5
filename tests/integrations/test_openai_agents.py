"""The OpenAI Agents SDK sandbox backend through the SDK's real ``Runner``, ``SandboxAgent`` and its tools; the
model is the SDK's own scripted one (``agents.testing.ScriptedModel``), standing in only for the LLM."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from agents import RunConfig, Runner, set_tracing_disabled
from agents.items import ToolCallOutputItem
from agents.sandbox import LocalSnapshotSpec, SandboxAgent, SandboxRunConfig
from agents.sandbox.errors import WorkspaceReadNotFoundError
from agents.testing import ScriptedModel, assistant_message, function_call

from bunshin_async.integrations.openai_agents import (
    BunshinSandboxClient,
    BunshinSandboxClientOptions,
    BunshinSandboxSessionState,
)

from .conftest import Clean

set_tracing_disabled(True)  # no trace exporter: nothing leaves the machine


def _agent(*commands: str) -> SandboxAgent:
    steps: list[object] = [
        [function_call("exec_command", {"cmd": cmd, "yield_time_ms": 60_000}, call_id=f"c{i}")]
        for i, cmd in enumerate(commands)
    ]
    steps.append([assistant_message("done")])
    return SandboxAgent(name="coder", instructions="Work in the sandbox.", model=ScriptedModel(steps))


def _outputs(result: object) -> list[str]:
    return [str(item.output) for item in result.new_items if isinstance(item, ToolCallOutputItem)]  # type: ignore[attr-defined]


async def _read(session: object, path: str) -> bytes:
    stream: io.IOBase = await session.read(Path(path))  # type: ignore[attr-defined]
    data = stream.read()
    assert isinstance(data, bytes)
    return data


async def test_runner_runs_exec_command_in_a_workspace_it_creates(clean: Clean) -> None:
    async with BunshinSandboxClient() as client:
        config = RunConfig(sandbox=SandboxRunConfig(client=client, options=BunshinSandboxClientOptions(pids=256)))
        result = await Runner.run(_agent("echo hello > f.txt && cat f.txt && hostname && pwd"), "go", run_config=config)
        assert result.final_output == "done"
        (out,) = _outputs(result)
        assert "hello\nbunshin\n/workspace" in out, out
        # The Runner created the session, so it deletes it at the end: no workspace is left running.
        assert client.live_workspaces == []
    await clean()


async def test_live_session_serialize_resume_and_fork(tmp_path: Path, clean: Clean) -> None:
    async with BunshinSandboxClient() as client:
        session = await client.create(snapshot=LocalSnapshotSpec(base_path=tmp_path), options=None)
        await session.start()
        config = RunConfig(sandbox=SandboxRunConfig(session=session))
        result = await Runner.run(
            _agent("echo v1 > state.txt", "sleep 600 >/dev/null 2>&1 & echo started"), "go", run_config=config
        )
        assert result.final_output == "done" and "started" in _outputs(result)[1]
        assert await _read(session, "state.txt") == b"v1\n"
        ws_id = session.state.workspace_id
        assert ws_id and [ws.id for ws in client.live_workspaces] == [ws_id]

        # Serialize / resume in this process: the same live workspace, processes and all.
        payload = json.loads(json.dumps(client.serialize_session_state(session.state)))
        state = client.deserialize_session_state(payload)
        assert isinstance(state, BunshinSandboxSessionState) and state.workspace_id == ws_id
        resumed = await client.resume(state)
        await resumed.start()
        r = await resumed.exec("pgrep -x sleep >/dev/null && cat state.txt")
        assert r.exit_code == 0 and r.stdout == b"v1\n"

        # Fork: isolated live copies, the background process carried.
        copies = await client.fork(session, 2)
        await copies[0].write(Path("state.txt"), io.BytesIO(b"copy0\n"))
        assert await _read(copies[0], "state.txt") == b"copy0\n"
        assert await _read(copies[1], "state.txt") == b"v1\n"
        assert await _read(session, "state.txt") == b"v1\n"
        assert (await copies[1].exec("pgrep -x sleep")).exit_code == 0
        await Runner.run(
            _agent("echo from-copy >> state.txt"),
            "go",
            run_config=RunConfig(sandbox=SandboxRunConfig(session=copies[1])),
        )
        assert await _read(copies[1], "state.txt") == b"v1\nfrom-copy\n"
        assert len(client.live_workspaces) == 3
        for c in copies:
            await client.delete(c)
        assert len(client.live_workspaces) == 1

        # Persist to the snapshot, delete the workspace, resume elsewhere: a fresh workspace hydrated from it.
        await session.stop()
        payload = client.serialize_session_state(session.state)
        await client.delete(session)
        assert client.live_workspaces == []
        revived = await client.resume(client.deserialize_session_state(payload))
        await revived.start()
        assert revived.state.workspace_id not in ("", ws_id)
        assert await _read(revived, "state.txt") == b"v1\n"
        with pytest.raises(WorkspaceReadNotFoundError):
            await _read(revived, "missing.txt")
        await client.delete(revived)
    await clean()


async def test_cancelled_and_timed_out_runs_leave_no_workspace(clean: Clean) -> None:
    async with BunshinSandboxClient() as client:
        config = RunConfig(sandbox=SandboxRunConfig(client=client, options=BunshinSandboxClientOptions()))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(3):
                await Runner.run(_agent("sleep 120"), "go", run_config=config)
        task = asyncio.ensure_future(Runner.run(_agent("sleep 120"), "go", run_config=config))
        async with asyncio.timeout(60):  # cancelled once the run holds a workspace (a fixed wait may come before)
            while not client.live_workspaces:
                await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # Whatever the Runner did on the way out, the client closed every workspace it had started.
    assert client.live_workspaces == []
    await clean()
