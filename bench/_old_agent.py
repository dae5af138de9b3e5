"""The Python agent as it was before the C agent (``_guest.py`` on the image's python3.11, started by the
bunshin-init of that time), rebuilt from git history so that ``workspace_bench.py`` can measure both side by side
in one run. Bench-only: ``OldAgentWorkspace`` speaks protocol 1 through a client that drops the fields protocol 2
added; it supports start, exec, shells, ping and close (not fork)."""

from __future__ import annotations

import compileall
import os
import py_compile
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import anyio
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from bunshin_async import Workspace
from bunshin_async import _protocol as P
from bunshin_async._client import AgentClient, _receive_exact
from bunshin_async._core import WorkspaceCore
from bunshin_async._exceptions import WorkspaceClosed, WorkspaceStartError
from bunshin_async._image import _make_dev

REPO = Path(__file__).resolve().parent.parent
OLD_FIELDS = {
    "ping": {"version"},
    "exec": {"argv", "command", "cwd", "env", "stdin", "timeout", "max_output"},
    "shell_open": {"cwd", "env"},
    "shell_run": {"shell_id", "command", "timeout", "max_output"},
    "shell_close": {"shell_id"},
}


def old_revision() -> str | None:
    """The last commit before the C agent (the parent of the one that added native/agent.c), or None outside a
    git checkout."""
    try:
        added = subprocess.run(
            ["git", "-C", str(REPO), "log", "--format=%H", "--diff-filter=A", "HEAD", "--", "native/agent.c"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{added[-1]}^" if added else None


class OldAgent:
    """The old agent layer and init binary, built in a temporary directory (``close()`` removes it)."""

    def __init__(self, rev: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bunshin-old-agent-"))
        try:

            def show(path: str) -> bytes:
                return subprocess.run(
                    ["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, check=True
                ).stdout

            (self.dir / "init.c").write_bytes(show("native/init.c"))
            self.init = self.dir / "bunshin-init"
            subprocess.run(["cc", "-O2", "-o", str(self.init), str(self.dir / "init.c")], check=True)
            self.layer = self.dir / "layer"
            opt = self.layer / "opt/bunshin"
            (opt / "lib").mkdir(parents=True)
            shutil.copy2(self.init, opt / "bunshin-init")
            (opt / "lib/bunshin_guest.py").write_bytes(show("bunshin_async/_guest.py"))
            (opt / "lib/_protocol.py").write_bytes(show("bunshin_async/_protocol.py"))
            (opt / "agent.py").write_text(
                'import sys\nsys.path.insert(0, "/opt/bunshin/lib")\nimport bunshin_guest\nbunshin_guest.main()\n'
            )
            shutil.copytree(
                Path(msgspec.__file__).parent, opt / "lib/msgspec", ignore=shutil.ignore_patterns("__pycache__")
            )
            unchecked = py_compile.PycInvalidationMode.UNCHECKED_HASH
            compileall.compile_dir(opt / "lib", quiet=1, ddir="/opt/bunshin/lib", invalidation_mode=unchecked)
            (self.layer / "run/bunshin").mkdir(parents=True, mode=0o700)
            _make_dev(self.layer / "dev")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class OldClient(AgentClient):
    """Protocol 1 on the wire: the fields protocol 2 added are dropped, answers decode as protocol 2."""

    async def request(self, req: P.Request) -> P.Response:
        d = msgspec.to_builtins(req, builtin_types=(bytes,))
        d = {k: v for k, v in d.items() if k == "op" or k in OLD_FIELDS[d["op"]]}
        if d["op"] == "ping":
            d["version"] = 1
        payload = msgspec.msgpack.encode(d)
        conn = self._idle.pop() if self._idle else await anyio.connect_unix(self.socket_path)
        ok = False
        try:
            await conn.send(struct.pack(">I", len(payload)) + payload)
            size = struct.unpack(">I", await _receive_exact(conn, 4))[0]
            body = await _receive_exact(conn, size)
            ok = True
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            raise WorkspaceClosed(f"old agent went away: {exc!r}", workspace_id=self.workspace_id) from exc
        finally:
            if ok:
                self._idle.append(conn)
            else:
                await conn.aclose()
        resp: P.Response = P.response_decoder.decode(body)
        return resp


class OldAgentCore(WorkspaceCore):
    """A workspace core whose pid 1 and agent are the old ones (``OldAgent``)."""

    old: OldAgent

    async def start(self) -> None:
        import bunshin_async._core as C

        real = C.agent_layer
        C.agent_layer = lambda: self.old.layer  # type: ignore[assignment]
        try:
            await super().start()
        finally:
            C.agent_layer = real

    async def spawn(self) -> None:
        assert self.cgroup is not None and self.lower is not None
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "BUNSHIN_WORKDIR": self.spec.workdir}
        argv = [
            str(self.old.init), "--lower", self.lower, "--upper", str(self.dir / "upper"),
            "--work", str(self.dir / "work"), "--root", str(self.dir / "root"), "--hostname", self.spec.hostname,
            "--python", "/usr/bin/python3", "--agent", "/opt/bunshin/agent.py", "--workdir", self.spec.workdir,
            "--self", "/opt/bunshin/bunshin-init",
        ]  # fmt: skip
        for procs in self.cgroup.procs_files:
            argv += ["--cgroup", procs]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        self.shim = await anyio.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert self.shim.stdout is not None
        status = BufferedByteReceiveStream(self.shim.stdout)
        ready = joined = False
        with anyio.fail_after(30):
            while not (ready and joined):
                line = (await status.receive_until(b"\n", 4096)).decode(errors="replace")
                if line.startswith("P "):
                    self.pid = int(line[2:])
                    self.pidfd = os.pidfd_open(self.pid)
                elif line.startswith("R"):
                    ready = True
                elif line.startswith("J"):
                    joined = True
                elif line.startswith("E "):
                    raise WorkspaceStartError(f"old agent: {line[2:]}", workspace_id=self.id)
        await self.shim.stdout.aclose()
        self.client = OldClient(f"/proc/{self.pid}/root/run/bunshin/agent.sock", self.id)


class OldAgentWorkspace(Workspace):
    """A workspace whose pid 1 and agent are the old ones (``OldAgent``): a ``Workspace`` over an ``OldAgentCore``."""

    def __init__(self, old: OldAgent) -> None:
        super().__init__()
        self._core = core = OldAgentCore(self._core.spec)
        core.old = old
