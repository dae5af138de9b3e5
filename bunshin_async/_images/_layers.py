"""The content-addressed layer store: image layers unpacked once each, by diff_id, in overlayfs form.

Layout under ``store_dir()`` (``$BUNSHIN_HOME/store``, ``BUNSHIN_IMAGE_STORE`` moves it; mode 0700, because a
hostile image's setuid binaries sit in it and must not be reachable by the host's other users)::

    .lock                       flock: imports hold it shared, ``gc``/``image rm`` exclusive
    layers/<hex>/root/          a layer's files (``hex`` is its diff_id: sha256 of the uncompressed tar)
    layers/<hex>/layer.json     its diff_id, apparent size and file count
    layers/<hex>.lock           flock held while one process unpacks that layer (concurrent imports wait)
    layers/.tmp-*/              a layer being unpacked (renamed into place when complete; ``owner`` for gc)
    images/<hex>.json           an image record: config digest, references, config, its diff_ids

The archives are untrusted: ``_untar`` unpacks them.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO, Any

import msgspec

from .._exceptions import ImageError
from .._host import _kernel, _paths, _tree
from ._untar import Budget, HashingReader, ImportLimits, LayerRejected, decompressed, extract_layer

__all__ = ["ImportLimits", "LayerStore", "store_dir"]

DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")


def store_dir() -> Path:
    env = os.environ.get("BUNSHIN_IMAGE_STORE")
    return Path(env) if env else _paths.home() / "store"


def digest_hex(digest: str, what: str = "digest") -> str:
    """The hex part of a ``sha256:<64 hex>`` digest; anything else (other algorithms, ``../``) is an ImageError."""
    m = DIGEST_RE.match(digest) if isinstance(digest, str) else None
    if m is None:
        raise ImageError(f"unsupported or malformed {what} {digest!r} (expected sha256:<64 hex digits>)", image=what)
    return m.group(1)


class LayerInfo(msgspec.Struct, frozen=True):
    diff_id: str
    size: int  # apparent bytes of its regular files
    entries: int


_info_decoder = msgspec.json.Decoder(LayerInfo)


class LayerStore:
    """Blocking operations on the layer store; ``Image`` calls them from worker threads."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or store_dir()
        self.layers = self.root / "layers"
        self.images = self.root / "images"

    def ensure(self) -> None:
        for d in (self.root, self.layers, self.images):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    @contextmanager
    def _flock(self, path: Path, how: int) -> Iterator[None]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)

    def shared(self) -> AbstractContextManager[None]:
        """Held by an import for its whole duration: ``gc`` and ``image rm`` wait for (or skip) running imports."""
        self.ensure()
        return self._flock(self.root / ".lock", fcntl.LOCK_SH)

    def exclusive(self, wait: bool = True) -> AbstractContextManager[None]:
        """Held by ``image rm`` and ``collect``; with ``wait=False`` entering raises BlockingIOError while an
        import runs."""
        self.ensure()
        return self._flock(self.root / ".lock", fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))

    def layer_dir(self, diff_id: str) -> Path:
        return self.layers / digest_hex(diff_id, "diff_id")

    def layer_root(self, diff_id: str) -> Path:
        return self.layer_dir(diff_id) / "root"

    def has(self, diff_id: str) -> bool:
        return (self.layer_dir(diff_id) / "layer.json").exists()

    def info(self, diff_id: str) -> LayerInfo:
        return _info_decoder.decode((self.layer_dir(diff_id) / "layer.json").read_bytes())

    def add(
        self,
        diff_id: str,
        opener: Callable[[], IO[bytes]],
        limits: ImportLimits,
        budget: Budget,
        cancel: threading.Event | None = None,
        *,
        image: str,
        blob_digest: str | None = None,
    ) -> bool:
        """Unpack the layer ``diff_id`` unless it is stored; returns whether it was unpacked now. The call holds
        the layer's lock while unpacking, so a concurrent import of the same layer waits and then reuses it. A
        rejected archive raises ImageError and leaves nothing (the temp dir is removed)."""
        hexd = digest_hex(diff_id, "diff_id")
        final = self.layers / hexd
        if self.has(diff_id):
            budget.used += self.info(diff_id).size
            return False
        with self._flock(self.layers / f"{hexd}.lock", fcntl.LOCK_EX):
            if self.has(diff_id):
                budget.used += self.info(diff_id).size
                return False
            tmp = self.layers / f".tmp-{hexd[:12]}-{secrets.token_hex(4)}"
            tmp.mkdir(mode=0o700)
            try:
                (tmp / "owner").write_text(_kernel.owner_token(os.getpid()))
                (tmp / "root").mkdir(mode=0o755)
                with opener() as raw:
                    head = raw.read(4)
                    raw.seek(0)
                    compressed = head[:2] == b"\x1f\x8b"
                    # an uncompressed blob is its tar: its digest is the diff_id, hashed once below
                    blob = HashingReader(raw, 1 << 62, cancel, hashing=compressed and blob_digest is not None)
                    try:
                        got, size, entries = extract_layer(
                            decompressed(head, blob),
                            tmp / "root",
                            limits,
                            budget,
                            cancel,
                        )
                        blob.drain()
                    except LayerRejected as exc:
                        raise ImageError(f"layer {diff_id[:19]}: {exc}; nothing was stored", image=image) from None
                if got != diff_id:
                    raise ImageError(
                        f"layer {diff_id[:19]}: its content hashes to {got}, not to the diff_id the image names",
                        image=image,
                    )
                blob_got = f"sha256:{blob.sha.hexdigest()}" if blob.hashing else got
                if blob_digest is not None and blob_got != blob_digest:
                    raise ImageError(f"layer blob {blob_digest[:19]} does not match its digest", image=image)
                (tmp / "layer.json").write_bytes(msgspec.json.encode(LayerInfo(diff_id, size, entries)))
                (tmp / "owner").unlink()
                if final.exists():  # a dir without layer.json: a crashed import's rename cannot leave one
                    _tree.remove_tree(final)
                tmp.rename(final)
            finally:
                if tmp.exists():
                    _rmtree(tmp)
        return True

    # ------------------------------------------------------------------------------------------------ records

    def record_path(self, digest: str) -> Path:
        return self.images / f"{digest_hex(digest, 'image digest')}.json"

    def write_record(self, digest: str, record: dict[str, Any]) -> None:
        path = self.record_path(digest)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        tmp.rename(path)

    def records(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        for p in sorted(self.images.glob("*.json")) if self.images.is_dir() else []:
            try:
                yield p, json.loads(p.read_text())
            except (OSError, ValueError):
                continue

    # ------------------------------------------------------------------------------------------------ gc

    def collect(self) -> list[str]:
        """Remove layers no image record names and no live overlay mounts, and abandoned temp dirs (blocking).
        Skips (and says so) while an import holds the store."""
        if not self.root.exists():
            return []
        try:
            with self.exclusive(wait=False):
                return self._collect()
        except BlockingIOError:
            return ["kept image layers (an import is running; run gc again later)"]

    def _collect(self) -> list[str]:
        out: list[str] = []
        wanted = {
            d.removeprefix("sha256:")
            for _p, rec in self.records()
            for d in rec.get("diff_ids", [])
            if isinstance(d, str)
        }
        mounted = mounted_lower_dirs()
        for entry in sorted(self.layers.iterdir()):
            name = entry.name
            if name.startswith(".tmp-"):
                owner = entry / "owner"
                token = owner.read_text().strip() if owner.exists() else ""
                if token and _kernel.alive(token):
                    continue
                _rmtree(entry)
                out.append(f"removed partial layer {name}")
            elif name.endswith(".lock"):
                if not (self.layers / name[: -len(".lock")]).exists():
                    entry.unlink(missing_ok=True)
            elif name not in wanted:
                if any(str(p) in mounted for p in (entry / "root", *entry.glob("root.shift-*"))):
                    out.append(f"kept layer {name[:12]} (mounted by a live workspace)")
                    continue
                _rmtree(entry)
                (self.layers / f"{name}.lock").unlink(missing_ok=True)
                out.append(f"removed layer {name[:12]}")
        return out


def _rmtree(path: Path) -> None:
    """Remove a layer directory (a hostile image's tree: any depth, read-only dirs, symlinks never followed)."""
    _tree.discard(path)


def mounted_lower_dirs() -> set[str]:
    """Every lower directory of every overlay mounted in any mount namespace on the host (one process per
    namespace is read). Workspaces mount their roots in private namespaces, invisible in our own mountinfo."""
    seen: set[str] = set()
    dirs: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            ns = os.readlink(f"/proc/{pid}/ns/mnt")
            if ns in seen:
                continue
            with open(f"/proc/{pid}/mountinfo") as f:
                text = f.read()
        except OSError:
            continue
        seen.add(ns)
        for line in text.splitlines():
            if " - overlay " not in line:
                continue
            for opt in line.rsplit(" ", 1)[-1].split(","):
                key, _, value = opt.partition("=")
                if key in ("lowerdir", "lowerdir+"):
                    dirs.update(value.split(":"))
    return dirs
