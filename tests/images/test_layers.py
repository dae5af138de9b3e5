"""The layer store and the archive formats on hand-made archives: whiteouts in overlayfs form, the OCI layout (dir,
tarball, gzip layers), the docker-save OCI form, digests checked, concurrent and cancelled imports, and hostile
archives, each an ImageError with nothing written outside the store and no partial layer in it."""

from __future__ import annotations

import os
import stat
import tarfile
import threading
from pathlib import Path

import anyio
import pytest

from bunshin_async import Image, ImageError, ImportLimits
from bunshin_async._images._layers import LayerStore
from bunshin_async._images._oci import import_archive
from bunshin_async._images._untar import ImportCancelled

from ._archives import d, gnu_sparse_tar, layer_tar, member, sha, tar_dir, write_oci
from ._faults import HeldUnpack

BASE = layer_tar(
    [
        d("etc"),
        member("etc/motd", b"base motd\n"),
        d("data"),
        member("data/gone", b"gone\n"),
        d("data/opq"),
        member("data/opq/old", b"old\n"),
        d("data/redo"),
        member("data/redo/old", b"old\n"),
        member("data/file", b"v1\n"),
        member("data/hard", b"shared inode\n"),
        member("data/hard2", type=tarfile.LNKTYPE, linkname="data/hard"),
        member("data/abs-link", type=tarfile.SYMTYPE, linkname="/etc/motd"),
        member("data/fifo", type=tarfile.FIFOTYPE),
        d("dev"),
        member("dev/null", type=tarfile.CHRTYPE, devmajor=1, devminor=3),
    ]
)
TOP = layer_tar(
    [
        member("data/.wh.gone"),
        member("data/opq/.wh..wh..opq"),
        member("data/opq/new", b"new\n"),
        member("data/.wh.redo"),
        d("data/redo"),
        member("data/redo/new", b"new\n"),
        member("data/file", b"v2\n"),
        member("setuid", b"#!/bin/sh\n", mode=0o4755),
    ]
)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _no_partial(store: LayerStore) -> None:
    left = [p.name for p in store.layers.iterdir() if not p.name.endswith(".lock")] if store.layers.exists() else []
    assert left == [], f"partial layers left: {left}"


async def test_whiteouts_and_opaque_dirs_in_overlay_form(tmp_path: Path, fresh_store: LayerStore) -> None:
    digest = write_oci(tmp_path / "oci", [BASE, TOP], config={"Env": ["A=1", "B=two=2"], "WorkingDir": "/srv"})
    image = await Image.from_oci(tmp_path / "oci", store=fresh_store)
    assert image.digest == digest and image.name == "test:latest"
    assert image.config.env == {"A": "1", "B": "two=2"} and image.config.working_dir == "/srv"
    top, base = (Path(p) for p in image.layers)
    assert top == fresh_store.layer_root(sha(TOP)) and base == fresh_store.layer_root(sha(BASE))
    gone = os.lstat(top / "data/gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == os.makedev(0, 0)
    assert os.getxattr(top / "data/opq", "trusted.overlay.opaque") == b"y"
    assert os.getxattr(top / "data/redo", "trusted.overlay.opaque") == b"y"  # deleted, then made again
    assert not os.path.lexists(top / "data/.wh.gone") and not os.path.lexists(top / "data/opq/.wh..wh..opq")
    assert os.stat(top / "setuid").st_mode & 0o7777 == 0o4755
    assert os.stat(base / "data/hard").st_ino == os.stat(base / "data/hard2").st_ino
    assert os.readlink(base / "data/abs-link") == "/etc/motd"
    assert not os.path.lexists(base / "data/fifo") and not os.path.lexists(base / "dev/null")  # dropped
    assert os.stat(fresh_store.root).st_mode & 0o777 == 0o700  # setuid files of images: root only
    # the same layers again: nothing is unpacked, the record is reused
    inode = os.stat(top).st_ino
    again = await Image.from_oci(tmp_path / "oci", store=fresh_store, name="again")
    assert again.layers == image.layers and os.stat(top).st_ino == inode
    assert Image.load("again", store=fresh_store).digest == digest
    assert Image.load(digest[7:19], store=fresh_store).digest == digest


async def test_tarball_layout_gzip_layers_and_docker_oci_form(tmp_path: Path, fresh_store: LayerStore) -> None:
    digest = write_oci(tmp_path / "oci", [BASE, TOP], compress=True, docker_manifest=True, ref="img:1")
    tarball = tar_dir(tmp_path / "oci", tmp_path / "oci.tar")
    a = await Image.from_oci(tarball, store=fresh_store)
    b = await Image.from_docker_archive(tmp_path / "oci", store=fresh_store)  # Docker 25+'s save: manifest.json
    assert a.digest == b.digest == digest and a.layers == b.layers
    assert (Path(a.layers[0]) / "data/opq/new").read_text() == "new\n"
    assert Image.load("img:1", store=fresh_store).digest == digest


async def test_digest_mismatch_is_an_image_error(tmp_path: Path, fresh_store: LayerStore) -> None:
    write_oci(tmp_path / "oci", [BASE])
    blob = tmp_path / "oci" / "blobs" / "sha256" / sha(BASE).split(":")[1]
    blob.write_bytes(BASE.replace(b"base motd", b"evil motd"))
    with pytest.raises(ImageError, match="hashes to"):
        await Image.from_oci(tmp_path / "oci", store=fresh_store)
    _no_partial(fresh_store)


async def test_concurrent_imports_of_one_layer_unpack_it_once(tmp_path: Path, fresh_store: LayerStore) -> None:
    big = layer_tar([member(f"f{i}", os.urandom(64 << 10)) for i in range(200)])
    write_oci(tmp_path / "a", [big], ref="a:1")
    write_oci(tmp_path / "b", [big, TOP], ref="b:1")
    results: list[Image] = []

    async def one(path: Path) -> None:
        results.append(await Image.from_oci(path, store=fresh_store))

    async with anyio.create_task_group() as tg:
        for path in (tmp_path / "a", tmp_path / "b", tmp_path / "a"):
            tg.start_soon(one, path)
    layer = fresh_store.layer_root(sha(big))
    assert {r.layers[-1] for r in results} == {str(layer)} and len(_files(layer)) == 200
    assert sorted(p.name for p in fresh_store.layers.iterdir() if not p.name.endswith(".lock")) == sorted(
        [sha(big)[7:], sha(TOP)[7:]]
    )


async def test_cancelled_import_leaves_no_partial_layer(tmp_path: Path) -> None:
    big = layer_tar([member(f"f{i}", os.urandom(1 << 20)) for i in range(300)])
    write_oci(tmp_path / "oci", [big])
    fresh_store = HeldUnpack(tmp_path / "store", after=100 << 20)  # cancelled with ~100 files unpacked
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: Image.from_oci(tmp_path / "oci", store=fresh_store))
        with anyio.fail_after(120):
            while not fresh_store.unpacking.is_set():  # noqa: ASYNC110 - a thread's event
                await anyio.sleep(0.01)
        assert len(list(next(fresh_store.layers.glob(".tmp-*")).glob("root/f*"))) > 50
        tg.cancel_scope.cancel()
    _no_partial(fresh_store)
    assert list(fresh_store.images.glob("*.json")) == []
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ImportCancelled):
        import_archive(tmp_path / "oci", "oci", store=fresh_store, cancel=cancel)
    _no_partial(fresh_store)


async def test_sparse_file_keeps_its_holes(tmp_path: Path, fresh_store: LayerStore) -> None:
    raw = gnu_sparse_tar("sparse", 64 << 20, [(0, b"head" * 128), (32 << 20, b"mid!" * 1024)])
    write_oci(tmp_path / "oci", [raw])
    image = await Image.from_oci(tmp_path / "oci", store=fresh_store)
    path = Path(image.layers[0]) / "sparse"
    st = path.stat()
    assert st.st_size == 64 << 20 and st.st_blocks * 512 < 1 << 20  # holes, not 64 MiB of zeros
    with path.open("rb") as f:
        assert f.read(512) == b"head" * 128
        f.seek(32 << 20)
        assert f.read(4096) == b"mid!" * 1024
        f.seek(16 << 20)
        assert f.read(16) == bytes(16)


# ---------------------------------------------------------------------------------------------------- hostile


def _canary(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    return outside


HOSTILE = {
    "dotdot": lambda o: [member("../../../../../../../../etc/x", b"pwned\n")],
    "dotdot-to-canary": lambda o: [member("../../../../" + "outside/x", b"pwned\n")],
    "absolute-name": lambda o: [member(f"{o}/x", b"pwned\n")],
    "symlink-then-write-through": lambda o: [
        member("escape", type=tarfile.SYMTYPE, linkname=str(o)),
        member("escape/x", b"pwned\n"),
    ],
    "relative-symlink-then-write-through": lambda o: [
        d("a"),
        member("a/up", type=tarfile.SYMTYPE, linkname="../../../../../../../../../.."),
        member(f"a/up{o}/x", b"pwned\n"),
    ],
    "hardlink-to-etc-shadow": lambda o: [member("shadow", type=tarfile.LNKTYPE, linkname="/etc/shadow")],
    "hardlink-dotdot": lambda o: [member("shadow", type=tarfile.LNKTYPE, linkname="../../../../../../etc/shadow")],
    "hardlink-through-symlink": lambda o: [
        member("etc", type=tarfile.SYMTYPE, linkname="/etc"),
        member("shadow", type=tarfile.LNKTYPE, linkname="etc/shadow"),
    ],
    "hardlink-not-in-layer": lambda o: [member("shadow", type=tarfile.LNKTYPE, linkname="etc/shadow")],
    "device-node": lambda o: [d("usr"), member("usr/sda", type=tarfile.BLKTYPE, devmajor=8, devminor=0)],
    "char-device": lambda o: [member("mem", type=tarfile.CHRTYPE, devmajor=1, devminor=1)],
    "whiteout-through-symlink": lambda o: [
        member("w", type=tarfile.SYMTYPE, linkname=str(o)),
        member("w/.wh.x"),
    ],
    "opaque-through-symlink": lambda o: [
        member("w", type=tarfile.SYMTYPE, linkname=str(o)),
        member("w/.wh..wh..opq"),
    ],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_archive(case: str, tmp_path: Path, fresh_store: LayerStore) -> None:
    outside = _canary(tmp_path)
    shadow = os.stat("/etc/shadow")
    assert not os.path.lexists("/etc/x")
    raw = layer_tar([member("ok", b"fine\n"), *HOSTILE[case](outside)])
    write_oci(tmp_path / "oci", [raw])
    before = _files(tmp_path)
    with pytest.raises(ImageError) as info:
        await Image.from_oci(tmp_path / "oci", store=fresh_store)
    assert "nothing was stored" in str(info.value)
    assert list(outside.iterdir()) == []
    assert not os.path.lexists("/etc/x")
    after = os.stat("/etc/shadow")
    assert (after.st_nlink, after.st_mtime_ns, after.st_ino) == (shadow.st_nlink, shadow.st_mtime_ns, shadow.st_ino)
    new = {p for p in _files(tmp_path) - before if not p.startswith("store")}
    assert new == set(), new
    _no_partial(fresh_store)
    assert list(fresh_store.images.glob("*.json")) == []


async def test_sparse_file_over_the_limit(tmp_path: Path, fresh_store: LayerStore) -> None:
    raw = gnu_sparse_tar("huge", 10 << 30, [(0, b"x" * 512), ((10 << 30) - 512, b"y" * 512)])
    write_oci(tmp_path / "oci", [raw])
    free = os.statvfs(tmp_path).f_bfree
    with pytest.raises(ImageError, match="past"):
        await Image.from_oci(tmp_path / "oci", store=fresh_store)  # the default per-layer limit is 8 GiB
    _no_partial(fresh_store)
    assert abs(os.statvfs(tmp_path).f_bfree - free) < (256 << 20) // os.statvfs(tmp_path).f_frsize
    small = ImportLimits(max_layer_bytes=1 << 20)
    write_oci(tmp_path / "oci2", [layer_tar([member("a", bytes(600 << 10)), member("b", bytes(600 << 10))])])
    with pytest.raises(ImageError, match="past 1048576"):
        await Image.from_oci(tmp_path / "oci2", store=fresh_store, limits=small)
    _no_partial(fresh_store)


async def test_oversized_metadata_and_garbage(tmp_path: Path, fresh_store: LayerStore) -> None:
    long_name = layer_tar([member("x" * 5000, b"long name")])  # a pax header of ~5 kB
    write_oci(tmp_path / "a", [long_name])
    with pytest.raises(ImageError, match="metadata header"):
        await Image.from_oci(tmp_path / "a", store=fresh_store, limits=ImportLimits(max_metadata_bytes=1024))
    write_oci(tmp_path / "b", [b"not a tar at all" * 100])
    with pytest.raises(ImageError):
        await Image.from_oci(tmp_path / "b", store=fresh_store)
    with pytest.raises(ImageError, match="not an OCI image layout"):
        await Image.from_oci(tmp_path / "b" / "blobs", store=fresh_store)
    with pytest.raises(ImageError, match="does not exist"):
        await Image.from_oci(tmp_path / "nope", store=fresh_store)
    _no_partial(fresh_store)


async def test_archive_paths_stay_inside_the_archive(tmp_path: Path, fresh_store: LayerStore) -> None:
    import json

    write_oci(tmp_path / "oci", [BASE], docker_manifest=True)
    manifest = json.loads((tmp_path / "oci" / "manifest.json").read_text())
    manifest[0]["Layers"] = ["../../../../../../etc/passwd"]
    (tmp_path / "oci" / "manifest.json").write_text(json.dumps(manifest))
    # names resolve inside the layout (its root is their /), so this one names <layout>/etc/passwd
    with pytest.raises(ImageError, match="lacks ../../../../../../etc/passwd"):
        await Image.from_docker_archive(tmp_path / "oci", store=fresh_store)
    with pytest.raises(ImageError, match="lacks ../../../../../../etc/passwd"):
        await Image.from_docker_archive(tar_dir(tmp_path / "oci", tmp_path / "oci.tar"), store=fresh_store)
    (tmp_path / "oci" / "escape").symlink_to("/etc/passwd")
    manifest[0]["Layers"] = ["escape"]
    (tmp_path / "oci" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ImageError, match="points outside the layout"):
        await Image.from_docker_archive(tmp_path / "oci", store=fresh_store)
    index = json.loads((tmp_path / "oci" / "index.json").read_text())
    index["manifests"][0]["digest"] = "sha256:../../../../etc/passwd"
    (tmp_path / "oci" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ImageError, match="malformed blob digest"):
        await Image.from_oci(tmp_path / "oci", store=fresh_store)
    _no_partial(fresh_store)


def test_concurrent_imports_in_two_processes(tmp_path: Path, fresh_store: LayerStore) -> None:
    import subprocess
    import sys

    big = layer_tar([member(f"f{i}", os.urandom(256 << 10)) for i in range(200)])
    write_oci(tmp_path / "oci", [big, TOP])
    code = (
        "import anyio, sys; from pathlib import Path; from bunshin_async import Image; "
        "from bunshin_async._images._layers import LayerStore; "
        "im = anyio.run(lambda: Image.from_oci(sys.argv[1], store=LayerStore(Path(sys.argv[2])))); print(im.digest)"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "oci"), str(fresh_store.root)], stdout=subprocess.PIPE
        )
        for _ in range(3)
    ]
    digests = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(digests) == 1
    assert len(_files(fresh_store.layer_root(sha(big)))) == 200
    assert sorted(p.name for p in fresh_store.layers.iterdir() if not p.name.endswith(".lock")) == sorted(
        [sha(big)[7:], sha(TOP)[7:]]
    )


async def test_repeated_members_the_later_wins(tmp_path: Path, fresh_store: LayerStore) -> None:
    raw = layer_tar(
        [
            member("f", b"first\n"),
            member("f", b"second\n"),
            member("s", type=tarfile.SYMTYPE, linkname="/etc/passwd"),
            member("s", b"a file now\n"),  # replaces the symlink, never writes through it
            member("x", b"file\n"),
            d("x"),
            member("x/in", b"in a dir now\n"),
            d("x"),
        ]
    )
    write_oci(tmp_path / "oci", [raw])
    root = Path((await Image.from_oci(tmp_path / "oci", store=fresh_store)).layers[0])
    assert (root / "f").read_text() == "second\n" and (root / "s").read_text() == "a file now\n"
    assert not (root / "s").is_symlink() and (root / "x/in").read_text() == "in a dir now\n"
    write_oci(tmp_path / "bad", [layer_tar([d("x"), member("x", b"over a dir\n")])])
    with pytest.raises(ImageError, match="would replace a directory"):
        await Image.from_oci(tmp_path / "bad", store=fresh_store)
