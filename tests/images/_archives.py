"""Archives made by hand in tests: tar layers (including hostile ones), OCI image layouts and ``docker save``
archives in Docker 25+'s OCI form, converted from the legacy ``docker save`` output of Docker 20.10."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def member(
    name: str,
    data: bytes = b"",
    *,
    type: bytes = tarfile.REGTYPE,
    linkname: str = "",
    mode: int = 0o644,
    devmajor: int = 0,
    devminor: int = 0,
) -> tuple[tarfile.TarInfo, bytes | None]:
    ti = tarfile.TarInfo(name)
    ti.type = type
    ti.mode = mode
    ti.mtime = 1_700_000_000
    ti.linkname = linkname
    ti.devmajor, ti.devminor = devmajor, devminor
    if type == tarfile.REGTYPE:
        ti.size = len(data)
        return ti, data
    return ti, None


def d(name: str, mode: int = 0o755) -> tuple[tarfile.TarInfo, bytes | None]:
    return member(name, type=tarfile.DIRTYPE, mode=mode)


def layer_tar(members: Iterable[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def gnu_sparse_tar(name: str, real_size: int, runs: list[tuple[int, bytes]]) -> bytes:
    """A tar holding one old-GNU sparse member ('S'): ``runs`` of data at offsets, holes elsewhere, apparent size
    ``real_size`` (tarfile can read these but not write them, so the header is made here)."""
    assert len(runs) <= 4
    stored = b"".join(data for _off, data in runs)
    ti = tarfile.TarInfo(name)
    ti.size = len(stored)
    ti.mtime = 1_700_000_000
    ti.mode = 0o644
    header = bytearray(ti.tobuf(format=tarfile.GNU_FORMAT))
    block = header[-512:] if len(header) > 512 else header
    block[156:157] = b"S"
    pos = 386
    for off, data in runs:
        block[pos : pos + 12] = tarfile.itn(off, 12, tarfile.GNU_FORMAT)
        block[pos + 12 : pos + 24] = tarfile.itn(len(data), 12, tarfile.GNU_FORMAT)
        pos += 24
    block[482] = 0
    block[483:495] = tarfile.itn(real_size, 12, tarfile.GNU_FORMAT)
    block[148:156] = b"        "
    chksum = sum(block[:512])
    block[148:156] = b"%06o\0 " % chksum
    padded = stored + b"\0" * (-len(stored) % 512)
    return bytes(block) + padded + b"\0" * 1024


def config_doc(diff_ids: list[str], config: dict[str, Any] | None = None) -> bytes:
    doc = {
        "architecture": "amd64",
        "os": "linux",
        "config": config or {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    return json.dumps(doc).encode()


def write_oci(
    out: Path,
    layers: list[bytes],
    *,
    config: dict[str, Any] | None = None,
    ref: str | None = "test:latest",
    compress: bool = False,
    docker_manifest: bool = False,
) -> str:
    """An OCI image layout in ``out`` with ``layers`` (uncompressed tars, bottom first); returns the config
    digest. ``docker_manifest`` adds the manifest.json of Docker 25+'s ``docker save`` (OCI form)."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> str:
        digest = sha(data)
        (blobs / digest.split(":")[1]).write_bytes(data)
        return digest

    descs = []
    for raw in layers:
        blob = gzip.compress(raw, mtime=0) if compress else raw
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else "")
        descs.append({"mediaType": media, "digest": put(blob), "size": len(blob)})
    cfg = config_doc([sha(raw) for raw in layers], config)
    cfg_digest = put(cfg)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": len(cfg)},
            "layers": descs,
        }
    ).encode()
    mdesc: dict[str, Any] = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": put(manifest),
        "size": len(manifest),
    }
    if ref:
        mdesc["annotations"] = {"org.opencontainers.image.ref.name": ref, "io.containerd.image.name": ref}
    (out / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [mdesc]}))
    (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    if docker_manifest:
        entry = {
            "Config": f"blobs/sha256/{cfg_digest.split(':')[1]}",
            "RepoTags": [ref] if ref else None,
            "Layers": [f"blobs/sha256/{dd['digest'].split(':')[1]}" for dd in descs],
        }
        (out / "manifest.json").write_text(json.dumps([entry]))
    return cfg_digest


def tar_dir(src: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as tf:
        for p in sorted(src.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(src)), recursive=False)
    return dest


def legacy_save_to_oci(save_tar: Path, out: Path, ref: str) -> str:
    """Docker 20.10's legacy ``docker save`` output re-laid as Docker 25+'s (OCI layout + manifest.json)."""
    with tarfile.open(save_tar) as tf:
        entry = json.load(tf.extractfile("manifest.json"))[0]  # type: ignore[arg-type]
        layers = []
        for path in entry["Layers"]:
            f = tf.extractfile(path)
            assert f is not None
            layers.append(f.read())
        f = tf.extractfile(entry["Config"])
        assert f is not None
        config = json.load(f).get("config")
    return write_oci(out, layers, config=config, ref=ref, docker_manifest=True)
