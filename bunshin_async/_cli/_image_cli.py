"""``bunshin image import|ls|rm``: the layer store from the command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio

from .._exceptions import BunshinError
from .._images._image import Image
from .._images._layers import LayerStore
from .._images._oci import list_records, remove_refs


def image_command(args: argparse.Namespace) -> int:
    store = LayerStore()
    try:
        if args.action == "import":
            image = anyio.run(_import, args.source, _kind(Path(args.source)), args.name, store)
            print(f"imported {image.digest} ({len(image.layers)} layers) as {image.name}")
            return 0
        if args.action == "ls":
            rows = [("DIGEST", "REFERENCES", "LAYERS", "SIZE", "IMPORTED")]
            for _path, rec in list_records(store):
                when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(rec.imported))
                refs = ",".join(rec.refs) or "-"
                rows.append((rec.digest[7:19], refs, str(len(rec.diff_ids)), f"{rec.size / 2**20:.0f} MiB", when))
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            for r in rows:
                print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
            return 0
        if args.action == "rm":
            for line in remove_refs(store, args.refs) + store.collect():
                print(line)
            return 0
    except BunshinError as exc:
        print(f"bunshin image {args.action}: {exc}", file=sys.stderr)
        return 1
    return 2


def _kind(path: Path) -> str:
    """A path holding manifest.json is a `docker save` archive, another path an OCI layout; else an engine REF."""
    if not path.exists():
        return "engine"
    return "docker" if (path / "manifest.json").exists() or _tar_has(path, "manifest.json") else "oci"


async def _import(source: str, kind: str, name: str | None, store: LayerStore) -> Image:
    if kind == "docker":
        return await Image.from_docker_archive(source, name=name, store=store)
    if kind == "oci":
        return await Image.from_oci(source, name=name, store=store)
    return await Image.from_docker(source, store=store)


def _tar_has(path: Path, name: str) -> bool:
    import tarfile

    if not path.is_file():
        return False
    try:
        with tarfile.open(path) as tf:
            return any(m.name.lstrip("./") == name for m in tf)
    except (tarfile.TarError, OSError):
        return False
