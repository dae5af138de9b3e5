"""Workspace images: read-only root filesystems that every workspace's overlay stacks on.

The base image is a minimal Debian bookworm rootfs built once with debootstrap from the mirror the host's apt already
uses, then cached under ``$BUNSHIN_HOME/images``. It is built from Debian's packages alone, so it carries none of the
host's secrets (no /root, /home, host /etc/shadow or sockets). The GUI image (``Image.gui()``) is the same recipe
plus a virtual X server and the X tools the GUI tools run inside the workspace. The agent layer (pid 1's
``bunshin-init`` and the static ``bunshin-agent``, a /dev tree) is a second, tiny lower layer stacked above any image;
it needs nothing from the image, so any root filesystem works, one without Python or a shell included.

Users' container images (``Image.from_oci``, ``Image.from_docker_archive``, ``Image.from_docker``) are imported into
the layer store (``_layers``, ``_oci``): each layer unpacked once, by diff_id, in overlayfs form, and shared by every
image that has it; the workspace stacks them as its lower layers, top first, under the agent layer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import anyio
import msgspec

from .._exceptions import CapabilityMissing, ImageError
from .._host import _paths
from .._host._userns import shifted
from . import _docker
from ._layers import LayerStore
from ._oci import ImageConfig, ImageRecord, add_record, find_record, import_archive, load_record, run_cancellable
from ._untar import ImportLimits

BASE_NAME = "debian-bookworm"
BASE_SUITE = "bookworm"
# What agents in RL tasks reach for: a shell, python with pip and venv, git, the usual text tools, tmux for
# terminal programs, procps for ps/kill.
BASE_PACKAGES = (
    "python3",
    "python3-pip",
    "python3-venv",
    "git",
    "ca-certificates",
    "procps",
    "tmux",
    "patch",
    "diffutils",
    "file",
    "less",
    "xz-utils",
    "bzip2",
)
GUI_NAME = "debian-bookworm-gui"
# The GUI variant adds what ``Workspace(display=...)`` and ``ws.gui`` run inside the workspace: Xvfb, xdotool (input),
# python3-xlib (screenshots, window list), and what agents drive: xterm, Tk, a Mesa software OpenGL client
# (mesa-utils' glxgears; libgl1-mesa-dri brings llvmpipe). x11-utils (xdpyinfo, xwininfo) is for people debugging
# a workspace. One small TrueType font, because Tk draws with Xft and finds no core fonts without it.
# debootstrap follows Depends only, never Recommends, which keeps the image small.
GUI_PACKAGES = (
    *BASE_PACKAGES,
    "xvfb",
    "xdotool",
    "x11-utils",
    "xterm",
    "python3-tk",
    "python3-xlib",
    "mesa-utils",
    "libgl1-mesa-dri",
    "fonts-dejavu-core",
)
AGENT_DIR = "/opt/bunshin"


class Image(msgspec.Struct, frozen=True):
    """A read-only root filesystem. ``digest`` identifies its content for cache keys (for an imported container
    image, its config digest: Docker's image ID).

    ``rootfs`` is the directory of a ``from_dir`` image (empty for an imported one); ``layers`` are an imported
    image's layer directories in the layer store, top first; ``config`` is its Env, WorkingDir, User, Entrypoint
    and Cmd, which ``Workspace`` honours (env under ``env=``, WorkingDir as the default ``workdir``, User as the
    default user, Entrypoint/Cmd for ``ws.start_entrypoint()``).
    """

    name: str
    rootfs: str
    digest: str
    layers: tuple[str, ...] = ()
    config: ImageConfig = msgspec.field(default_factory=ImageConfig)

    @property
    def lower_dirs(self) -> str:
        """The image's part of an overlay lowerdir chain (top first)."""
        return ":".join(self.layers) if self.layers else self.rootfs

    # ------------------------------------------------------------------------------------------------ imports

    @classmethod
    def _from_record(cls, rec: ImageRecord, store: LayerStore, name: str | None = None) -> Image:
        missing = [d for d in rec.diff_ids if not store.has(d)]
        if missing:
            raise ImageError(
                f"image {rec.digest[:19]} lacks {len(missing)} of its layers in {store.layers}; import it again",
                image=rec.digest,
            )
        top_first: list[str] = []
        for d in reversed(rec.diff_ids):  # a layer listed twice: its topmost copy gives the same merged tree
            p = str(store.layer_root(d))
            if p not in top_first:
                top_first.append(p)
        return cls(
            name=name or (rec.refs[0] if rec.refs else rec.digest[:19]),
            rootfs="",
            digest=rec.digest,
            layers=tuple(top_first),
            config=rec.config,
        )

    @classmethod
    def load(cls, ref: str, *, store: LayerStore | None = None) -> Image:
        """An image already in the layer store, by reference (``name:tag``), digest or digest prefix (12+ hex
        digits). Blocking (reads one small record); raises ImageError if it was never imported."""
        store = store or LayerStore()
        rec = find_record(store, ref)
        if rec is None:
            raise ImageError(
                f"no image {ref!r} in the layer store {store.root}; import it first "
                "(`bunshin image import REF|PATH`, or Image.from_oci/from_docker_archive/from_docker)",
                image=ref,
            )
        return cls._from_record(rec, store, name=ref if ref in rec.refs else None)

    @classmethod
    async def from_oci(
        cls,
        path: str | os.PathLike[str],
        *,
        ref: str | None = None,
        name: str | None = None,
        limits: ImportLimits | None = None,
        store: LayerStore | None = None,
    ) -> Image:
        """Import an OCI image layout (a directory, or a tarball of one). ``ref`` picks one image of a layout
        holding several (by its ``org.opencontainers.image.ref.name``); ``name`` is recorded as a reference.
        Layers already in the store are not unpacked again. A hostile or malformed archive raises ImageError and
        leaves no partial layer; cancelling waits for the importing thread to clean up."""
        return await cls._import(path, "oci", ref, name, limits, store)

    @classmethod
    async def from_docker_archive(
        cls,
        path: str | os.PathLike[str],
        *,
        ref: str | None = None,
        name: str | None = None,
        limits: ImportLimits | None = None,
        store: LayerStore | None = None,
    ) -> Image:
        """Import a ``docker save`` archive (the legacy form or Docker 25+'s OCI form); ``ref`` picks one of
        several images by its RepoTags. Otherwise as ``from_oci``."""
        return await cls._import(path, "docker", ref, name, limits, store)

    @classmethod
    async def _import(
        cls,
        path: str | os.PathLike[str],
        kind: str,
        ref: str | None,
        name: str | None,
        limits: ImportLimits | None,
        store: LayerStore | None,
    ) -> Image:
        store = store or LayerStore()
        rec = await run_cancellable(
            lambda cancel: import_archive(path, kind, ref=ref, name=name, store=store, limits=limits, cancel=cancel)
        )
        return cls._from_record(rec, store, name=name or ref)

    @classmethod
    async def from_docker(
        cls,
        ref: str,
        *,
        engine: _docker.DockerEngine | None = None,
        limits: ImportLimits | None = None,
        store: LayerStore | None = None,
    ) -> Image:
        """Import ``ref`` from the local Docker engine (through aiodocker: ``pip install bunshin[docker]``; the
        asyncio backend). An image whose config digest is already in the store is not exported again."""
        store = store or LayerStore()
        engine = engine or _docker.AiodockerEngine()
        image_id = await engine.image_id(ref)
        rec = await anyio.to_thread.run_sync(load_record, store, image_id)
        if rec is not None and all(store.has(d) for d in rec.diff_ids):
            if ref not in rec.refs:
                rec = await anyio.to_thread.run_sync(
                    add_record, store, msgspec.structs.replace(rec, refs=(*rec.refs, ref))
                )
            return cls._from_record(rec, store, name=ref)
        await anyio.to_thread.run_sync(store.ensure)
        tmp = store.root / f".export-{secrets.token_hex(6)}.tar"
        try:
            await engine.save(image_id, tmp)
            image = await cls._import(tmp, "docker", None, ref, limits, store)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: tmp.unlink(missing_ok=True))
        if image.digest != image_id:
            raise ImageError(f"the engine exported {image.digest[:19]} for {ref!r} ({image_id[:19]})", image=ref)
        return image

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], *, name: str | None = None) -> Image:
        """Use a directory holding a root filesystem; it is never written to. The agent needs nothing from it:
        command strings and shell sessions need /bin/bash or /bin/sh, argv commands and the file tools nothing."""
        root = Path(path).resolve()
        if not root.is_dir():
            raise ImageError(f"image directory {str(root)!r} does not exist", image=str(root))
        manifest = root.parent / "manifest.json"
        digest = None
        if manifest.exists():
            digest = json.loads(manifest.read_text()).get("digest")
        if digest is None:
            st = root.stat()
            digest = hashlib.sha256(f"{root}:{st.st_ino}:{st.st_mtime_ns}".encode()).hexdigest()
        return cls(name=name or root.name, rootfs=str(root), digest=digest)

    @classmethod
    def base(cls) -> Image:
        """The cached Debian base image; build it with ``bunshin image build`` (``make setup`` does)."""
        root = _paths.images_dir() / BASE_NAME / "rootfs"
        if not (root.parent / "manifest.json").exists():
            raise ImageError(
                f"base image {BASE_NAME} is not built at {root}; run `bunshin image build` (or `make setup`)",
                image=BASE_NAME,
            )
        return cls.from_dir(root, name=BASE_NAME)

    @classmethod
    def gui(cls) -> Image:
        """The cached GUI image (base + X server and tools); build it with ``bunshin image build --gui``."""
        root = _paths.images_dir() / GUI_NAME / "rootfs"
        if not (root.parent / "manifest.json").exists():
            raise ImageError(
                f"GUI image {GUI_NAME} is not built at {root}; run `bunshin image build --gui` (or `make setup`)",
                image=GUI_NAME,
            )
        return cls.from_dir(root, name=GUI_NAME)


def _recipe_digest(packages: tuple[str, ...] = BASE_PACKAGES) -> str:
    return hashlib.sha256(f"{BASE_SUITE}:{','.join(packages)}:v1".encode()).hexdigest()


def apt_mirror() -> str:
    """The Debian archive URI the host's apt is configured with (never a hard-coded host). Any suite of it will do:
    a Debian 13 host's archive serves bookworm too."""
    texts = []
    for p in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if p.is_file() and p.suffix in ("", ".list", ".sources"):
            texts.append(p.read_text())
    uris: list[str] = []
    for text in texts:
        uris += re.findall(r"^URIs:\s*(\S+)", text, re.M)
        uris += re.findall(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s", text, re.M)
    for uri in uris:
        if "security" not in uri and re.search(r"/debian/?$", uri):
            return uri
    raise CapabilityMissing(
        "no Debian archive in the host's apt sources",
        capability="debian-mirror",
        remedy="add a Debian archive (deb http://deb.debian.org/debian bookworm main) to /etc/apt/sources.list",
    )


def build_base_image(force: bool = False) -> Image:
    """Build (or reuse) the base image. Idempotent: a complete build is recognised by its manifest."""
    _build(BASE_NAME, BASE_PACKAGES, force)
    return _with_shifted_copy(Image.base())


def build_gui_image(force: bool = False) -> Image:
    """Build (or reuse) the GUI image: the base recipe plus ``GUI_PACKAGES``, cached beside it."""
    _build(GUI_NAME, GUI_PACKAGES, force)
    return _with_shifted_copy(Image.gui())


def _with_shifted_copy(image: Image) -> Image:
    """Make the image's shifted copy for the workspaces' user namespace now (_userns), so that the first
    workspace does not wait for it."""
    shifted(Path(image.rootfs))
    return image


def _build(name: str, packages: tuple[str, ...], force: bool) -> None:
    target = _paths.images_dir() / name
    manifest = target / "manifest.json"
    digest = _recipe_digest(packages)
    if not force and manifest.exists() and json.loads(manifest.read_text()).get("digest") == digest:
        return
    if shutil.which("debootstrap") is None:
        raise CapabilityMissing(
            "debootstrap is not installed", capability="debootstrap", remedy="apt-get install debootstrap"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        rootfs = tmp / "rootfs"
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(packages)}",
                BASE_SUITE,
                str(rootfs),
                apt_mirror(),
            ],
            check=True,
        )
        _scrub(rootfs)
        (tmp / "manifest.json").write_text(json.dumps({"name": name, "digest": digest}))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _scrub(rootfs: Path) -> None:
    """Drop what debootstrap copies from the host or leaves behind for apt."""
    for rel in ("etc/resolv.conf", "etc/hostname"):
        p = rootfs / rel
        if p.exists() or p.is_symlink():
            p.unlink()
    (rootfs / "etc/hostname").write_text("bunshin\n")
    (rootfs / "etc/hosts").write_text("127.0.0.1 localhost bunshin\n::1 localhost\n")
    for rel in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = rootfs / rel
        if d.is_dir():
            for child in d.iterdir():
                if child.is_file():
                    child.unlink()
    (rootfs / "workspace").mkdir(exist_ok=True)


def _stat_key(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _layer_name(stats: tuple[tuple[object, ...], ...]) -> str:
    """Digest of the layer's binaries (about 1 MiB each), computed once per process and version of them: hashing
    them at every start would cost a few ms of create-to-first-exec."""
    h = hashlib.sha256(f"{LAYER_LAYOUT}".encode())
    for rel, src, *_ in stats:
        assert isinstance(rel, str) and isinstance(src, Path)
        h.update(rel.encode())
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


LAYER_LAYOUT = 4
"""Bumped when what ``agent_layer`` lays out changes (2: the /dev tree; 3: the static C agent; 4: the empty
directory masked /proc and /sys paths show), so hosts build the new layer."""

DEV_NODES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
DEV_LINKS = {
    "ptmx": "pts/ptmx",
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
}


def _make_dev(dev: Path) -> None:
    """A workspace's /dev, as a directory of the agent layer rather than a tmpfs: CRIU archives every tmpfs with
    tar at each dump and restore (~4 ms each, twice per fork for /dev and /dev/shm), while a layer costs nothing to
    fork. Opaque, so the image's own /dev (a host console node, say) stays hidden; pid 1 mounts a private devpts
    instance on /dev/pts; /dev/shm is an ordinary sticky directory that forks with the files."""
    import stat

    dev.mkdir(mode=0o755)
    for name, (major, minor) in DEV_NODES.items():
        os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(dev / name, 0o666)  # mknod obeys the umask
    for name, target in DEV_LINKS.items():
        os.symlink(target, dev / name)
    (dev / "pts").mkdir(mode=0o755)
    (dev / "shm").mkdir()
    os.chmod(dev / "shm", 0o1777)
    os.chmod(dev, 0o755)
    os.setxattr(dev, "trusted.overlay.opaque", b"y")


def agent_layer() -> Path:
    """The overlay layer holding pid 1's binary and the agent, built once per version (content-addressed)."""
    sources = {"bunshin-init": _paths.init_binary(), "bunshin-agent": _paths.agent_binary()}
    stats = tuple((rel, src, *_stat_key(src)) for rel, src in sorted(sources.items()))
    layer = _paths.agent_layers_dir() / _layer_name(stats)
    if (layer / ".complete").exists():
        return layer / "root"
    layer.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".agent-", dir=layer.parent))
    try:
        opt = tmp / "root" / AGENT_DIR.lstrip("/")
        opt.mkdir(parents=True)
        for rel, src in sources.items():
            shutil.copy2(src, opt / rel)
        (opt / "empty").mkdir(mode=0o555)  # what pid 1 mounts over masked directories (native/security.c)
        (tmp / "root" / "run" / "bunshin").mkdir(parents=True, mode=0o700)
        _make_dev(tmp / "root" / "dev")
        (tmp / ".complete").touch()
        try:
            tmp.rename(layer)
        except OSError:  # another process won the race
            shutil.rmtree(tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return layer / "root"
