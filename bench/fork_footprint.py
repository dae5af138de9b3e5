"""What a speculative fork of a small workspace holds, and what a committed one leaves its rollout, by the
experiment's own reading (``Subtree.read``: PSS, page images beyond PSS, the snapshot store, upper dirs), item by
item (issue #38: on tiny workspaces the GiB·s launch rule refuses forks that the oracle would commit).

One run, in an accounting scope of its own: a rollout (an idle shell workspace that ran ``--calls`` short commands
and wrote ``--write-kib`` KiB), then, ``--hits`` times over, a fork of it beside it (``fork``: both alive, as a
branch is until the ask), the branch's call in the fork, then the commit (``committed``: the source closed, the copy
is the rollout now, as ``WorkspaceHandle`` does at a hit). Each reading is broken down: PSS by process, page images
mapped beyond their PSS, the snapshot store's bytes by kind (page images, pagemaps, the other CRIU images, layers,
reference files), upper dirs. Prints JSON; figures are bytes.

    .venv/bin/python bench/fork_footprint.py --hits 3

``--twin N``: whether a committed copy goes on holding less than a fresh workspace (what the launch rule's
``ForkMemory.extra`` counts to the rollout's end): two fresh workspaces run the same ``--calls``; one is forked and
committed; both run the same N calls more (shells, python, writes), read after each (the subtree's total and each
one's ``workspace_memory``); then the fresh one is committed too.

    .venv/bin/python bench/fork_footprint.py --twin 16
"""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path
from typing import Any

import anyio

from bunshin_async import Workspace
from bunshin_async._host import _tree
from bunshin_async._workspace._accounting import Subtree, _mapped_images, accounting_scope, workspace_memory


def _kind(rel: Path) -> str:
    """What a file of the snapshot store is, by its place and name."""
    parts = rel.parts
    if parts and parts[0] == ".layers":
        return "layer_refs" if len(parts) > 1 and parts[1].endswith(".users") else "layers"
    if parts and parts[0].endswith(".users"):
        return "snapshot_refs"
    name = rel.name
    if name.startswith("pages-") and name.endswith(".img"):
        return "page_images"
    if name.startswith("pagemap-") and name.endswith(".img"):
        return "pagemaps"
    if name.endswith(".img"):
        return "other_images"
    if "upper" in parts:
        return "upper_copies"
    return "other_files"


def store_breakdown(snapshot_dir: Path, mapped: set[tuple[int, int]]) -> dict[str, Any]:
    """The snapshot directory's bytes by kind (st_blocks), page images that processes map counted apart (the
    reading counts those as ``image_bytes``, not again here), and the image files by name pattern."""
    kinds: dict[str, int] = {}
    names: dict[str, int] = {}
    for e in _tree.walk(snapshot_dir):
        if stat.S_ISDIR(e.st.st_mode):
            continue
        rel = Path(*e.parents(), e.name)
        kind = _kind(rel)
        if (e.st.st_dev, e.st.st_ino) in mapped:
            kind = "page_images_mapped"
        size = e.st.st_blocks * 512
        kinds[kind] = kinds.get(kind, 0) + size
        if rel.name.endswith(".img"):
            pattern = rel.name.split("-")[0].removesuffix(".img")
            names[pattern] = names.get(pattern, 0) + size
    return {"by_kind": kinds, "images_by_name": dict(sorted(names.items(), key=lambda x: -x[1]))}


def _process_pss(pids: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    out[comm] = out.get(comm, 0) + int(line.split()[1]) * 1024
        except OSError:
            pass
    return out


def reading(subtree: Subtree, workspaces: dict[str, Workspace]) -> dict[str, Any]:
    """One reading of the subtree (``Subtree.read``, the experiment's) and what each part of it is."""
    usage = subtree.read()
    pids = subtree.pids()
    sizes, _pss = _mapped_images(pids)
    assert subtree.snapshot_dir is not None
    return {
        "memory_bytes": usage.memory_bytes,
        "pss_bytes": usage.pss_bytes,
        "image_bytes": usage.image_bytes,
        "snapshot_bytes": usage.snapshot_bytes,
        "upper_bytes": usage.upper_bytes,
        "processes": usage.processes,
        "pss_by_process": _process_pss(pids),
        "mapped_page_images": len(sizes),
        "mapped_page_image_bytes": sum(sizes.values()),
        "store": store_breakdown(subtree.snapshot_dir, set(sizes)),
        "workspace_memory": {name: workspace_memory(ws) for name, ws in workspaces.items() if not ws.closed},
    }


async def run(calls: int, write_kib: int, hits: int) -> dict[str, Any]:
    out: dict[str, Any] = {"pid": os.getpid(), "calls": calls, "write_kib": write_kib, "steps": []}
    with accounting_scope("fork-footprint") as subtree:
        rollout = await Workspace().__aenter__()
        try:
            for i in range(calls):
                await rollout.exec(f"echo call {i} > /dev/null")
            if write_kib:
                await rollout.exec(f"head -c {write_kib * 1024} /dev/urandom > /workspace/written.bin")
            step = await anyio.to_thread.run_sync(reading, subtree, {"rollout": rollout})
            out["steps"].append({"step": "rollout", **step})
            for hit in range(hits):
                (fork,) = await rollout.fork(1)
                step = await anyio.to_thread.run_sync(reading, subtree, {"rollout": rollout, "fork": fork})
                out["steps"].append({"step": f"fork {hit + 1}", **step})
                async with anyio.create_task_group() as tg:  # read beside the branch's call, as the runtime does
                    tg.start_soon(fork.exec, "echo branch call > /workspace/branch.txt; sleep 1")
                    await anyio.sleep(0.3)
                    step = await anyio.to_thread.run_sync(reading, subtree, {"rollout": rollout, "fork": fork})
                    out["steps"].append({"step": f"fork {hit + 1}, its call running", **step})
                await rollout.aclose()  # the commit: the rollout moves into the fork, its old workspace closes
                rollout = fork
                step = await anyio.to_thread.run_sync(reading, subtree, {"rollout": rollout})
                out["steps"].append({"step": f"committed {hit + 1}", **step})
        finally:
            await rollout.aclose()
    return out


TWIN_CALLS = (
    "echo a > /dev/null",
    "ls / > /dev/null",
    "python3 -c 'import json' || true",
    "head -c 65536 /dev/urandom > /tmp/x.bin",
    "cat /etc/os-release > /dev/null",
    "python3 -c 'import os' || true",
    "sh -c 'for i in 1 2 3; do echo $i; done' > /dev/null",
    "echo b >> /tmp/log.txt",
)


async def twin(calls: int, later: int) -> dict[str, Any]:
    """A committed copy and a fresh workspace side by side over ``later`` calls (``--twin``)."""
    out: dict[str, Any] = {"pid": os.getpid(), "calls": calls, "readings": []}
    with accounting_scope("fork-footprint-twin") as subtree:
        copy, fresh = await Workspace().__aenter__(), await Workspace().__aenter__()
        try:
            for i in range(calls):
                await copy.exec(f"echo call {i} > /dev/null")
                await fresh.exec(f"echo call {i} > /dev/null")

            def read(step: str) -> dict[str, Any]:
                return {"step": step, "memory_bytes": subtree.read().memory_bytes,
                        "copy": workspace_memory(copy), "fresh": workspace_memory(fresh)}  # fmt: skip

            out["readings"].append(await anyio.to_thread.run_sync(read, "before the commit"))
            (forked,) = await copy.fork(1)
            await copy.aclose()
            copy = forked
            for i in range(later):
                command = TWIN_CALLS[i % len(TWIN_CALLS)]
                await copy.exec(command)
                await fresh.exec(command)
                out["readings"].append(await anyio.to_thread.run_sync(read, f"call {i + 1}: {command}"))
            (forked,) = await fresh.fork(1)
            await fresh.aclose()
            fresh = forked
            out["readings"].append(await anyio.to_thread.run_sync(read, "the fresh one committed too"))
        finally:
            await copy.aclose()
            await fresh.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3, help="short commands the rollout runs first")
    parser.add_argument("--write-kib", type=int, default=64, help="KiB the rollout writes before the first fork")
    parser.add_argument("--hits", type=int, default=3, help="forks committed one after another")
    parser.add_argument("--twin", type=int, help="a committed copy beside a fresh twin over N more calls instead")
    args = parser.parse_args()
    if args.twin is not None:
        print(json.dumps(anyio.run(twin, args.calls, args.twin), indent=1))
        return
    print(json.dumps(anyio.run(run, args.calls, args.write_kib, args.hits), indent=1))


if __name__ == "__main__":
    main()
