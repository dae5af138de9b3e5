"""Reading container images: OCI image layouts (a directory or its tarball) and ``docker save`` archives (the legacy
form and the OCI-in-docker-save form of Docker 25+), into the layer store (``_layers``).

An image is its config (``sha256`` of the config blob is the image's digest: Docker's image ID) and its layers,
bottom first (``rootfs.diff_ids``). Every document and blob of the archive is untrusted: JSON documents are bounded
in size, digests are checked (a manifest and config against their descriptor, each layer's uncompressed stream
against its diff_id), and names inside a tarball are resolved inside the tarball.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import posixpath
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio
import msgspec

from .._exceptions import ImageError
from ._layers import LayerStore, digest_hex
from ._untar import Budget, ImportLimits

__all__ = ["ImageConfig", "ImageRecord", "import_archive", "run_cancellable"]

MANIFEST_TYPES = {
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
}
INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
REF_ANNOTATIONS = ("io.containerd.image.name", "org.opencontainers.image.ref.name")


class ImageConfig(msgspec.Struct, frozen=True):
    """What a container image's config says about how to run it (the OCI config's ``config`` object)."""

    env: dict[str, str] = msgspec.field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


class ImageRecord(msgspec.Struct, frozen=True):
    """An imported image as the store keeps it (``images/<hex>.json``)."""

    digest: str
    diff_ids: tuple[str, ...]  # bottom layer first, as in the config's rootfs
    config: ImageConfig = msgspec.field(default_factory=ImageConfig)
    refs: tuple[str, ...] = ()
    size: int = 0  # apparent bytes of the layers' files
    imported: float = 0.0
    source: str = ""


record_decoder = msgspec.json.Decoder(ImageRecord)


class _Source:
    """Random access to the named files of an archive (a directory or a tarball)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, name: str) -> IO[bytes]:
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def read(self, name: str, limit: int) -> bytes:
        with self.open(name) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ImageError(f"{name} in {self.path} is larger than {limit} bytes", image=str(self.path))
        return data

    def json(self, name: str, limit: int) -> Any:
        try:
            return json.loads(self.read(name, limit))
        except ValueError as exc:
            raise ImageError(f"{name} in {self.path} is not valid JSON: {exc}", image=str(self.path)) from None


def _norm(name: str) -> str:
    n = posixpath.normpath("/" + name).lstrip("/")
    return n


class _DirSource(_Source):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.root = path.resolve()

    def _resolve(self, name: str) -> Path:
        p = (self.root / _norm(name)).resolve()
        if p != self.root and self.root not in p.parents:
            raise ImageError(f"{name} in {self.path} points outside the layout", image=str(self.path))
        return p

    def exists(self, name: str) -> bool:
        return self._resolve(name).is_file()

    def open(self, name: str) -> IO[bytes]:
        p = self._resolve(name)
        if not p.is_file():
            raise ImageError(f"{self.path} lacks {name}", image=str(self.path))
        return p.open("rb")


class _TarSource(_Source):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            self.tf = tarfile.open(path, "r:*")
            members = self.tf.getmembers()
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise ImageError(f"{path} is not a readable tar archive: {exc}", image=str(path)) from None
        self.members = {_norm(m.name): m for m in members}

    def _member(self, name: str) -> tarfile.TarInfo:
        n = _norm(name)
        for _ in range(16):  # docker save links repeated layers: <id>/layer.tar -> ../<other>/layer.tar
            m = self.members.get(n)
            if m is None:
                raise ImageError(f"{self.path} lacks {name}", image=str(self.path))
            if m.issym():
                target = posixpath.normpath(posixpath.join(posixpath.dirname(n), m.linkname))
                if target.startswith("../") or target == ".." or m.linkname.startswith("/"):
                    raise ImageError(f"{name} in {self.path} links outside the archive", image=str(self.path))
                n = target
            elif m.islnk():
                n = _norm(m.linkname)
            elif m.isreg():
                return m
            else:
                raise ImageError(f"{name} in {self.path} is not a file", image=str(self.path))
        raise ImageError(f"{name} in {self.path}: too many links", image=str(self.path))

    def exists(self, name: str) -> bool:
        try:
            self._member(name)
        except ImageError:
            return False
        return True

    def open(self, name: str) -> IO[bytes]:
        f = self.tf.extractfile(self._member(name))
        assert f is not None
        return f

    def close(self) -> None:
        self.tf.close()


def open_source(path: str | os.PathLike[str]) -> _Source:
    p = Path(path)
    if p.is_dir():
        return _DirSource(p)
    if p.is_file():
        return _TarSource(p)
    raise ImageError(f"{str(p)!r} does not exist", image=str(p))


class _Layer(msgspec.Struct, frozen=True):
    diff_id: str
    path: str  # inside the source
    blob_digest: str | None


class _Parsed(msgspec.Struct, frozen=True):
    config_bytes: bytes
    layers: tuple[_Layer, ...]
    refs: tuple[str, ...]


def _host_arch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)


def _ref_matches(ref: str, names: list[str]) -> bool:
    return any(n == ref or n.endswith("/" + ref) or n == f"{ref}:latest" or n.split(":")[-1] == ref for n in names)


def _parse_oci(src: _Source, ref: str | None, limits: ImportLimits) -> _Parsed:
    image = str(src.path)
    cap = limits.max_metadata_bytes * 16
    layout = src.json("oci-layout", limits.max_metadata_bytes) if src.exists("oci-layout") else None
    if not isinstance(layout, dict) or "imageLayoutVersion" not in layout:
        raise ImageError(f"{image} is not an OCI image layout (no oci-layout file)", image=image)
    index = src.json("index.json", cap)
    candidates: list[tuple[dict[str, Any], list[str]]] = []

    def walk(doc: Any, depth: int) -> None:
        if depth > 4 or not isinstance(doc, dict) or not isinstance(doc.get("manifests"), list):
            raise ImageError(f"{image}: malformed image index", image=image)
        for desc in doc["manifests"]:
            if not isinstance(desc, dict):
                raise ImageError(f"{image}: malformed descriptor in the index", image=image)
            plat = desc.get("platform") or {}
            if plat and (plat.get("os") != "linux" or plat.get("architecture") != _host_arch()):
                continue
            names = [v for k, v in (desc.get("annotations") or {}).items() if k in REF_ANNOTATIONS]
            if desc.get("mediaType") in INDEX_TYPES:
                walk(_blob_json(src, desc, cap, image), depth + 1)
            elif desc.get("mediaType") in MANIFEST_TYPES or "mediaType" not in desc:
                candidates.append((desc, names))

    walk(index, 0)
    if ref is not None:
        picked = [c for c in candidates if _ref_matches(ref, c[1])]
        if not picked:
            raise ImageError(f"{image} holds no image named {ref!r}", image=image)
    else:
        picked = candidates
    if len(picked) != 1:
        names = sorted(n for c in candidates for n in c[1])
        raise ImageError(
            f"{image} holds {len(picked)} images for linux/{_host_arch()}; name one ({', '.join(names) or 'unnamed'})",
            image=image,
        )
    desc, names = picked[0]
    manifest = _blob_json(src, desc, cap, image)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict):
        raise ImageError(f"{image}: malformed image manifest", image=image)
    config_bytes = _blob_bytes(src, manifest["config"], cap, image)
    descs = manifest.get("layers")
    if not isinstance(descs, list):
        raise ImageError(f"{image}: the manifest lists no layers", image=image)
    diff_ids = _diff_ids(config_bytes, image)
    if len(diff_ids) != len(descs):
        raise ImageError(f"{image}: {len(descs)} layers but {len(diff_ids)} diff_ids in the config", image=image)
    layers = []
    for d, diff_id in zip(descs, diff_ids, strict=True):
        if not isinstance(d, dict):
            raise ImageError(f"{image}: malformed layer descriptor", image=image)
        digest = d.get("digest", "")
        layers.append(_Layer(diff_id, f"blobs/sha256/{digest_hex(digest, 'layer digest')}", digest))
    return _Parsed(config_bytes, tuple(layers), tuple(names))


def _blob_bytes(src: _Source, desc: dict[str, Any], cap: int, image: str) -> bytes:
    digest = desc.get("digest", "")
    data = src.read(f"blobs/sha256/{digest_hex(digest, 'blob digest')}", cap)
    if f"sha256:{hashlib.sha256(data).hexdigest()}" != digest:
        raise ImageError(f"{image}: blob {digest[:19]} does not match its digest", image=image)
    return data


def _blob_json(src: _Source, desc: dict[str, Any], cap: int, image: str) -> Any:
    try:
        return json.loads(_blob_bytes(src, desc, cap, image))
    except ValueError as exc:
        raise ImageError(f"{image}: blob {desc.get('digest', '')[:19]} is not JSON: {exc}", image=image) from None


def _diff_ids(config_bytes: bytes, image: str) -> list[str]:
    try:
        config = json.loads(config_bytes)
        diff_ids = config["rootfs"]["diff_ids"]
    except (ValueError, KeyError, TypeError):
        raise ImageError(f"{image}: the image config has no rootfs.diff_ids", image=image) from None
    if not isinstance(diff_ids, list):
        raise ImageError(f"{image}: rootfs.diff_ids is not a list", image=image)
    for d in diff_ids:
        digest_hex(d, "diff_id")
    return diff_ids


def _parse_docker(src: _Source, ref: str | None, limits: ImportLimits) -> _Parsed:
    image = str(src.path)
    cap = limits.max_metadata_bytes * 16
    if not src.exists("manifest.json"):
        raise ImageError(f"{image} is not a `docker save` archive (no manifest.json)", image=image)
    entries = src.json("manifest.json", cap)
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ImageError(f"{image}: malformed manifest.json", image=image)
    if ref is not None:
        picked = [e for e in entries if _ref_matches(ref, list(e.get("RepoTags") or []))]
        if not picked:
            raise ImageError(f"{image} holds no image named {ref!r}", image=image)
    else:
        picked = entries
    if len(picked) != 1:
        tags = sorted(t for e in entries for t in (e.get("RepoTags") or []))
        raise ImageError(f"{image} holds {len(picked)} images; name one ({', '.join(tags)})", image=image)
    entry = picked[0]
    config_path, paths = entry.get("Config"), entry.get("Layers")
    if not isinstance(config_path, str) or not isinstance(paths, list):
        raise ImageError(f"{image}: manifest.json names no Config or Layers", image=image)
    config_bytes = src.read(config_path, cap)
    diff_ids = _diff_ids(config_bytes, image)
    if len(diff_ids) != len(paths):
        raise ImageError(f"{image}: {len(paths)} layers but {len(diff_ids)} diff_ids in the config", image=image)
    layers = []
    for path, diff_id in zip(paths, diff_ids, strict=True):
        if not isinstance(path, str):
            raise ImageError(f"{image}: malformed layer path {path!r}", image=image)
        layers.append(_Layer(diff_id, path, None))
    return _Parsed(config_bytes, tuple(layers), tuple(entry.get("RepoTags") or ()))


def _config_of(config_bytes: bytes, image: str) -> ImageConfig:
    try:
        cfg = json.loads(config_bytes).get("config") or {}
        env: dict[str, str] = {}
        for item in cfg.get("Env") or []:
            key, sep, value = str(item).partition("=")
            if sep and key:
                env[key] = value
        return ImageConfig(
            env=env,
            working_dir=cfg.get("WorkingDir") or None,
            user=cfg.get("User") or None,
            entrypoint=tuple(str(a) for a in cfg.get("Entrypoint") or ()),
            cmd=tuple(str(a) for a in cfg.get("Cmd") or ()),
        )
    except (AttributeError, TypeError, ValueError):
        raise ImageError(f"{image}: malformed image config", image=image) from None


def import_archive(
    path: str | os.PathLike[str],
    kind: str,
    *,
    ref: str | None = None,
    name: str | None = None,
    store: LayerStore | None = None,
    limits: ImportLimits | None = None,
    cancel: threading.Event | None = None,
) -> ImageRecord:
    """Import an OCI layout (``kind="oci"``) or a ``docker save`` archive (``"docker"``; ``"auto"`` looks) into
    the store (blocking). Layers already stored are not read again. ``name`` is recorded as a reference."""
    store = store or LayerStore()
    limits = limits or ImportLimits()
    src = open_source(path)
    try:
        if kind == "auto":
            kind = "docker" if src.exists("manifest.json") else "oci"
        parsed = (_parse_docker if kind == "docker" else _parse_oci)(src, ref, limits)
        digest = f"sha256:{hashlib.sha256(parsed.config_bytes).hexdigest()}"
        config = _config_of(parsed.config_bytes, str(path))
        budget = Budget(limits)
        with store.shared():
            for layer in parsed.layers:

                def opener(layer: _Layer = layer) -> IO[bytes]:
                    return src.open(layer.path)

                store.add(
                    layer.diff_id,
                    opener,
                    limits,
                    budget,
                    cancel,
                    image=str(path),
                    blob_digest=layer.blob_digest,
                )
            refs = [*parsed.refs, *([name] if name else []), *([ref] if ref and not parsed.refs else [])]
            return add_record(
                store,
                ImageRecord(
                    digest=digest,
                    diff_ids=tuple(layer.diff_id for layer in parsed.layers),
                    config=config,
                    refs=tuple(dict.fromkeys(refs)),
                    size=budget.used,
                    imported=time.time(),
                    source=str(Path(path).resolve()),
                ),
            )
    finally:
        src.close()


def add_record(store: LayerStore, rec: ImageRecord) -> ImageRecord:
    """Write ``rec``, keeping the references an earlier import of the same image recorded; a reference moves
    to the newest image that claims it (as a docker tag does)."""
    old = load_record(store, rec.digest)
    if old is not None:
        rec = msgspec.structs.replace(rec, refs=tuple(dict.fromkeys([*old.refs, *rec.refs])))
    for _path, other in list_records(store):
        if other.digest != rec.digest and set(other.refs) & set(rec.refs):
            kept = tuple(r for r in other.refs if r not in rec.refs)
            store.write_record(other.digest, msgspec.to_builtins(msgspec.structs.replace(other, refs=kept)))
    store.write_record(rec.digest, msgspec.to_builtins(rec))
    return rec


def load_record(store: LayerStore, digest: str) -> ImageRecord | None:
    try:
        return record_decoder.decode(store.record_path(digest).read_bytes())
    except FileNotFoundError:
        return None
    except msgspec.DecodeError:
        return None


def list_records(store: LayerStore) -> list[tuple[Path, ImageRecord]]:
    out = []
    for p in sorted(store.images.glob("*.json")) if store.images.is_dir() else []:
        try:
            out.append((p, record_decoder.decode(p.read_bytes())))
        except (OSError, msgspec.DecodeError):
            continue
    return out


def remove_refs(store: LayerStore, refs: list[str]) -> list[str]:
    """``bunshin image rm``: a reference is dropped from its image, and an image left with none (or named by
    digest) is removed; its layers go at the next ``collect``. Waits for running imports. Raises ImageError for a
    reference no image has (after removing the others)."""
    out: list[str] = []
    unknown: list[str] = []
    with store.exclusive():
        for ref in refs:
            rec = find_record(store, ref)
            if rec is None:
                unknown.append(ref)
                continue
            kept = tuple(r for r in rec.refs if r not in (ref, f"{ref}:latest"))
            if kept and kept != rec.refs:
                store.write_record(rec.digest, msgspec.to_builtins(msgspec.structs.replace(rec, refs=kept)))
                out.append(f"untagged {ref} ({rec.digest[7:19]} keeps {', '.join(kept)})")
            else:
                store.record_path(rec.digest).unlink(missing_ok=True)
                out.append(f"removed image {rec.digest[7:19]} ({', '.join(rec.refs) or 'no references'})")
    if unknown:
        raise ImageError(f"no image {', '.join(map(repr, unknown))} in {store.root}", image=unknown[0])
    return out


def find_record(store: LayerStore, ref: str) -> ImageRecord | None:
    """A record by reference (``name:tag``; ``name`` means ``name:latest``), digest or unique digest prefix."""
    records = [r for _p, r in list_records(store)]
    for r in records:
        if ref in r.refs or f"{ref}:latest" in r.refs:
            return r
    key = ref.removeprefix("sha256:")
    if len(key) >= 12 and all(c in "0123456789abcdef" for c in key):
        hits = [r for r in records if r.digest.removeprefix("sha256:").startswith(key)]
        if len(hits) == 1:
            return hits[0]
    return None


T = TypeVar("T")


async def run_cancellable(fn: Callable[[threading.Event], T]) -> T:
    """Run a blocking import in a worker thread. Cancelling the caller asks the thread to stop (at its next read)
    and waits for it to clean up, so a cancelled import leaves nothing half made."""
    cancel = threading.Event()
    done = threading.Event()

    def work() -> T:
        try:
            return fn(cancel)
        finally:
            done.set()

    try:
        return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
    except BaseException:
        cancel.set()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(done.wait)
        raise
