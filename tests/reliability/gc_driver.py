"""A subprocess SDK whose snapshot stops at three points until the test says ``go`` (a line on stdin), so that the
test runs ``bunshin gc`` beside a dump there (``test_gc.py``; the test gives it its run dir and snapshot store):

- ``workspace``: its workspace's directory made and its disk mounted, its owner file not yet written (inside the run
  dir's shared section);
- ``section``: the snapshot's directory made, its users not yet written (inside the store's shared section);
- ``post-dump``: CRIU's dump in its post-dump notification (pages written, the tree frozen, the upper dir copied);
- ``stored``: the snapshot on the store, its layer not made yet (its first restore makes it).

It prints ``<point> <workspace or snapshot id>`` at each stop; then it restores a copy from the snapshot and closes
it, twice (the second needs the layer the first made, held by the snapshot alone in between), and prints ``done``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bunshin_async import Workspace  # noqa: E402
from bunshin_async._fork import _dump  # noqa: E402
from bunshin_async._host import _snapstore  # noqa: E402
from bunshin_async._workspace import _core  # noqa: E402


def stop(point: str, what: str) -> None:
    """Say where the workspace or snapshot stands and wait for the test (blocking)."""
    print(point, what, flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(f"no go at {point}")


async def main() -> None:
    ids: list[str] = []
    real_hold, real_finish = _dump.hold_layers, _snapstore.TreeCopy.finish

    def hold(layers: list[Path], user: str) -> None:  # in ``_open``'s worker thread, inside the store's section
        if user.startswith("snapshot-") and not ids:
            ids.append(user.removeprefix("snapshot-"))
            stop("section", ids[0])
        real_hold(layers, user)

    async def finish(self: _snapstore.TreeCopy) -> Any:  # in CRIU's post-dump notification
        copied = await real_finish(self)
        await anyio.to_thread.run_sync(stop, "post-dump", ids[0])
        return copied

    def mount_disk(directory: Path, size: int) -> None:  # in the first ``make_dirs``, before the owner file
        _core.mount_disk = real_mount
        real_mount(directory, size)
        stop("workspace", directory.name)

    real_mount, _core.mount_disk = _core.mount_disk, mount_disk
    async with Workspace() as ws:
        await ws.write_file("/workspace/kept", "kept\n")
        _dump.hold_layers, _snapstore.TreeCopy.finish = hold, finish  # type: ignore[assignment,method-assign]
        try:
            snap = await ws.snapshot()
        finally:
            _dump.hold_layers, _snapstore.TreeCopy.finish = real_hold, real_finish  # type: ignore[method-assign]
        async with snap:
            await anyio.to_thread.run_sync(stop, "stored", snap.id)
            for _ in range(2):
                [copy] = await Workspace.from_snapshot(snap)
                try:
                    assert (await copy.exec("cat /workspace/kept")).stdout == "kept\n"
                finally:
                    await copy.aclose()
    print("done", flush=True)


if __name__ == "__main__":
    anyio.run(main)
