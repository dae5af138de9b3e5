"""What a client holds: a host (``HostRef``), a workspace on it (``RemoteWorkspace``) and a snapshot it keeps
(``RemoteSnapshot``). A ``BunshinError`` raised in a host reaches the caller as itself, any other error raised in a
live host as ``HostCallError`` (the workspace stays usable); a host that died or cannot be reached is a
``HostError`` naming its node."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from ..._exceptions import BunshinError, HostError, InvalidValue, WorkspaceClosed
from ..._host._kernel import Limits
from ..._host._protocol import DirEntry, ExecResult
from . import _remote
from ._model import HostInfo, Reply


def _value(reply: Any) -> Any:
    assert isinstance(reply, Reply)
    if reply.error is not None:
        raise reply.error
    return reply.value


def made_workspaces(value: Any) -> list[tuple[str, str]]:
    """What to close of a ``fork``/``from_snapshot`` reply (``[(ws_id, fork_mode, limits), ...]``)."""
    return [("close", made[0]) for made in value]


def made_one(method: str) -> Callable[[Any], list[tuple[str, str]]]:
    """What to close of a reply whose first item is what was made (``create``, ``snapshot``, ``fetch``)."""
    return lambda value: [(method, value[0])]


class HostRef:
    """A host actor as clients see it: its handle (``actor``), its ``name`` and its Ray ``node_id``."""

    def __init__(self, actor: Any, name: str, node_id: str) -> None:
        self.actor = actor
        self.name = name
        self.node_id = node_id

    async def raw(self, method: str, *args: Any) -> Any:
        """The host's ``method(*args)`` as it returned it; ``HostError`` when the host died."""
        return await _remote.call(self.actor, method, *args, host=self.name)

    async def call(self, method: str, *args: Any) -> Any:
        """The value of the host's ``method(*args)``, or the ``BunshinError`` it raised, raised here."""
        return _value(await self.raw(method, *args))

    async def make(self, method: str, *args: Any, release: Callable[[Any], list[tuple[str, str]]]) -> Any:
        """``call`` for a method that makes workspaces or snapshots: cancelled after the host made them and before
        the reply came, the caller closes what ``release(value)`` names (``("close", ws_id)`` or
        ``("close_snapshot", snap_id)``) instead of leaving it held until its owner stops."""

        async def abandoned(reply: Any) -> None:
            if isinstance(reply, Reply) and reply.error is None:
                for close, one in release(reply.value):
                    with contextlib.suppress(BunshinError):  # a host that died freed it already
                        await self.call(close, one)

        return _value(await _remote.call(self.actor, method, *args, host=self.name, abandoned=abandoned))

    async def info(self) -> HostInfo:
        info = await self.raw("info")
        assert isinstance(info, HostInfo)
        return info

    def __repr__(self) -> str:
        return f"<HostRef {self.name}>"


class RemoteWorkspace:
    """A workspace on a host, driven through its actor: ``exec``, ``read_file``, ``read_text``, ``write_file``,
    ``list_dir``, ``remove``, ``spawn`` (returns the in-workspace pid; ``poll`` and ``signal`` take it), ``ping``,
    ``configure``, ``snapshot``, ``fork``, ``cache_call``, ``aclose`` (idempotent), with the errors a local
    ``Workspace`` raises. ``limits``: the workspace's resource limits, as its host made it. Picklable: pass it to
    another task or actor, the owner stays the cluster that made it."""

    def __init__(self, host: HostRef, ws_id: str, owner: str, fork_mode: str, limits: Limits | None = None) -> None:
        self.host = host
        self.id = ws_id
        self.owner = owner
        self.fork_mode = fork_mode
        self.limits = limits
        self.closed = False

    @property
    def node(self) -> str:
        return self.host.name

    def _check_open(self) -> None:
        if self.closed:
            raise WorkspaceClosed(f"workspace {self.id} is closed", workspace_id=self.id)

    async def _proxy(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        return await self.host.call("call", self.id, method, args, kwargs)

    async def exec(self, cmd: str | Sequence[str], **kwargs: Any) -> ExecResult:
        out = await self._proxy("exec", cmd, **kwargs)
        assert isinstance(out, ExecResult)
        return out

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        return bytes(await self._proxy("read_file", path, max_bytes=max_bytes))

    async def read_text(self, path: str) -> str:
        return str(await self._proxy("read_text", path))

    async def write_file(self, path: str, data: bytes | str, *, append: bool = False, mode: int | None = None) -> None:
        await self._proxy("write_file", path, data, append=append, mode=mode)

    async def list_dir(self, path: str = ".") -> list[DirEntry]:
        return list(await self._proxy("list_dir", path))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._proxy("remove", path, recursive=recursive)

    async def spawn(self, cmd: str | Sequence[str], **kwargs: Any) -> int:
        return int(await self._proxy("spawn", cmd, **kwargs))

    async def ping(self) -> int:
        return int(await self._proxy("ping"))

    async def poll(self, pid: int) -> int | None:
        """Exit code of the process ``spawn`` started as ``pid``, or None while it runs."""
        code = await self._proxy("poll", pid)
        return None if code is None else int(code)

    async def signal(self, pid: int, sig: int) -> None:
        """Send ``sig`` to the process ``spawn`` started as ``pid``."""
        await self._proxy("signal", pid, int(sig))

    async def configure(self, *, env: Mapping[str, str] | None = None, user: str | None = None) -> None:
        """Add ``env`` to the environment of the workspace's later commands; ``user`` becomes their default
        user (``Workspace.env`` and ``Workspace.user``)."""
        await self._proxy("configure", dict(env or {}), user)

    async def cache_call(self, tool: str, args: dict[str, Any]) -> tuple[str, Any]:
        """A tool call through the host's shared tool cache: ``(source, result)``, ``source`` as in
        ``CallRecord`` (``"executed"``, ``"hit"``, ``"restored"``, ...)."""
        self._check_open()
        source, result = await self.host.call("cache_call", self.id, tool, args)
        return str(source), result

    async def snapshot(self) -> RemoteSnapshot:
        snap_id, size = await self.host.make("snapshot", self.id, self.owner, release=made_one("close_snapshot"))
        return RemoteSnapshot(self.host, snap_id, self.owner, size)

    async def fork(self, n: int = 1, *, claim: str | None = None) -> list[RemoteWorkspace]:
        """``n`` live copies on this workspace's host; ``claim``: a reservation of their slots
        (``RayCluster.ledger``)."""
        made = await self.host.make("fork", self.id, n, self.owner, claim, release=made_workspaces)
        return [RemoteWorkspace(self.host, w, self.owner, mode, limits) for w, mode, limits in made]

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self.host.call("close", self.id)
            except HostError:
                pass  # a dead host freed it already

    async def __aenter__(self) -> RemoteWorkspace:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<RemoteWorkspace {self.id} on {self.host.name}>"


class RemoteSnapshot:
    """A snapshot held by a host. ``size``: bytes of its directory and layer there. ``owner`` None: the host's own
    copy (fetched with ``shared=True``), which the host keeps: closing the handle leaves it."""

    def __init__(self, host: HostRef, snap_id: str, owner: str | None, size: int) -> None:
        self.host = host
        self.id = snap_id
        self.owner = owner
        self.size = size
        self.closed = False

    async def from_snapshot(
        self, n: int = 1, owner: str | None = None, *, claim: str | None = None
    ) -> list[RemoteWorkspace]:
        """``n`` workspaces restored from the snapshot on its host, leased to ``owner`` (default the snapshot's);
        ``claim``: a reservation of their slots (``RayCluster.ledger``)."""
        who = owner or self.owner
        if who is None:
            raise InvalidValue(f"snapshot {self.id} is its host's own copy: name an owner", argument="owner")
        made = await self.host.make("from_snapshot", self.id, n, who, claim, release=made_workspaces)
        return [RemoteWorkspace(self.host, w, who, mode, limits) for w, mode, limits in made]

    async def aclose(self) -> None:
        if self.closed or self.owner is None:  # a host's own (fetched) copy is the host's to keep
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self.host.call("close_snapshot", self.id)
            except HostError:
                pass

    async def __aenter__(self) -> RemoteSnapshot:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<RemoteSnapshot {self.id} on {self.host.name}>"
