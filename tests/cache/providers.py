"""State providers for tests only, injected at the ``StateProvider`` interface.

``TarStateProvider`` stands in for the fork provider being built: it captures ``/workspace`` as a tar archive and
restores into a fresh workspace. It knows nothing of processes or files outside ``/workspace``, which is why it is
not shipped. ``BrokenStateProvider`` fails every restore, to check the fallback.
"""

from __future__ import annotations

import secrets

from bunshin_async import ForkError, Workspace
from bunshin_async.cache import SnapshotRef


class TarStateProvider:
    def __init__(self) -> None:
        self.snaps: dict[str, str] = {}
        self.captures = 0
        self.restores = 0
        self.discarded: list[str] = []

    async def capture(self, ws: Workspace) -> SnapshotRef:
        r = await ws.exec("tar -C /workspace -cf - . | base64 -w0", timeout=30)
        if r.exit_code != 0:
            raise ForkError(f"tar failed: {r.stderr}", workspace_id=ws.id)
        ref = SnapshotRef(secrets.token_hex(6), len(r.stdout))
        self.snaps[ref.id] = r.stdout
        self.captures += 1
        return ref

    async def restore(self, ws: Workspace, ref: SnapshotRef) -> Workspace:
        data = self.snaps.get(ref.id)
        if data is None:
            raise ForkError(f"snapshot {ref.id} is gone", workspace_id=ws.id)
        new = Workspace(image=ws.image, workdir=ws.workdir, env=ws.env, max_output=ws.max_output)
        await new.start()
        try:
            r = await new.exec("base64 -d | tar -C /workspace -xf -", stdin=data, timeout=30)
            if r.exit_code != 0:
                raise ForkError(f"untar failed: {r.stderr}", workspace_id=new.id)
        except BaseException:
            await new.aclose()
            raise
        self.restores += 1
        return new

    async def discard(self, ref: SnapshotRef) -> None:
        self.snaps.pop(ref.id, None)
        self.discarded.append(ref.id)


class BrokenStateProvider(TarStateProvider):
    async def restore(self, ws: Workspace, ref: SnapshotRef) -> Workspace:
        raise ForkError("restore is broken on purpose", workspace_id=ws.id)
