"""``bunshin image import|ls|rm`` and ``bunshin gc`` on the layer store: shared layers stored once, unreferenced
layers collected, layers a live workspace mounts kept, abandoned partial layers removed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest

from bunshin_async import Image, ImageError, Workspace
from bunshin_async._cli._main import main
from bunshin_async._images._layers import LayerStore

from . import _build
from ._archives import layer_tar, member, sha, tar_dir, write_oci

SHARED = layer_tar([member("shared/big", os.urandom(1 << 20))])
ONLY_A = layer_tar([member("a", b"a\n")])
ONLY_B = layer_tar([member("b", b"b\n")])


def _layer_names(store: LayerStore) -> set[str]:
    return {p.name for p in store.layers.iterdir() if not p.name.endswith(".lock")}


def test_import_ls_rm_gc(tmp_path: Path, fresh_store: LayerStore, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("BUNSHIN_IMAGE_STORE", str(fresh_store.root))
    write_oci(tmp_path / "a", [SHARED, ONLY_A], ref="a:1")
    write_oci(tmp_path / "b", [SHARED, ONLY_B], ref="b:1", docker_manifest=True)
    assert main(["image", "import", str(tmp_path / "a")]) == 0
    assert main(["image", "import", str(tar_dir(tmp_path / "b", tmp_path / "b.tar")), "--name", "bee"]) == 0
    out = capsys.readouterr().out
    assert "as a:1" in out and "as bee" in out
    assert _layer_names(fresh_store) == {sha(x)[7:] for x in (SHARED, ONLY_A, ONLY_B)}  # the shared one once
    assert main(["image", "ls"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split()[:3] == ["DIGEST", "REFERENCES", "LAYERS"] and len(listing) == 3
    assert any("b:1,bee" in line for line in listing)
    assert main(["image", "rm", "bee"]) == 0  # untags: b:1 still names it
    assert "untagged bee" in capsys.readouterr().out
    assert main(["image", "rm", "b:1"]) == 0
    out = capsys.readouterr().out
    assert "removed image" in out and f"removed layer {sha(ONLY_B)[7:19]}" in out
    assert _layer_names(fresh_store) == {sha(x)[7:] for x in (SHARED, ONLY_A)}
    assert main(["image", "rm", "nope:1"]) == 1
    assert "no image 'nope:1'" in capsys.readouterr().err
    assert Image.load("a:1", store=fresh_store).name == "a:1"
    with pytest.raises(ImageError, match="no image 'a'"):
        Image.load("a", store=fresh_store)  # a name alone means name:latest, as for docker
    assert main(["image", "import", str(tmp_path / "missing")]) == 1  # not a path: a REF the engine lacks


async def test_gc_keeps_mounted_layers_and_removes_partial_ones(
    tmp_path: Path, fresh_store: LayerStore, layers_image: Image
) -> None:
    # a workspace runs on an image whose record is gone: its layers are mounted, gc keeps them
    write_oci(tmp_path / "a", [ONLY_A])
    image = await Image.from_oci(tmp_path / "a", store=fresh_store)
    merged = Image(name="merged", rootfs="", digest="x", layers=(image.layers[0], *layers_image.layers))
    async with Workspace(merged) as ws:
        assert (await ws.exec("cat /a && test -d /data/opq")).stdout == "a\n"
        fresh_store.record_path(image.digest).unlink()
        out = await anyio.to_thread.run_sync(fresh_store.collect)
        assert out == [f"kept layer {sha(ONLY_A)[7:19]} (mounted by a live workspace)"]
    partial = fresh_store.layers / ".tmp-deadbeef0000-0000"
    (partial / "root").mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (partial / "owner").write_text(f"{dead.pid} 1")
    out = await anyio.to_thread.run_sync(fresh_store.collect)
    assert sorted(out) == sorted([f"removed layer {sha(ONLY_A)[7:19]}", "removed partial layer .tmp-deadbeef0000-0000"])
    assert _layer_names(fresh_store) == set()


def test_import_from_the_engine_by_reference(store: LayerStore, layers_image: Image, bookworm_tag: str, capsys) -> None:  # type: ignore[no-untyped-def]
    tag = _build.build("layers", bookworm_tag)
    assert main(["image", "import", tag]) == 0
    assert f"imported {layers_image.digest}" in capsys.readouterr().out
    assert Image.load(tag).digest == layers_image.digest
