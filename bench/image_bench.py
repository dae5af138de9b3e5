"""Image benchmark: importing a container image (~300 MB, 3 layers) into the layer store cold and warm, against
GNU tar unpacking the same layers; create-to-first-exec on an imported image against the built-in base image; disk
used by two images that share their base layer.

Uses the real Docker engine and the test images of tests/images (built and cached in the engine on first use).
Prints one JSON object; times in milliseconds (median, p90). ``BENCH_REPS`` sets the repetitions (default 3 for
imports, 10x that for starts).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from _stats import summary  # noqa: E402

from bunshin_async import Image, Workspace  # noqa: E402
from bunshin_async._images._docker import AiodockerEngine  # noqa: E402
from bunshin_async._images._layers import LayerStore  # noqa: E402
from tests.images import _build  # noqa: E402


def disk_bytes(path: Path) -> int:
    """Blocks actually used under ``path`` (hard links and shared layers counted once), in bytes."""
    out = subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def tar_baseline(save: Path, work: Path) -> float:
    """GNU tar unpacking the image's layer tars from the saved archive, one after another (no whiteouts, no
    checks): a floor for what unpacking costs."""
    with tarfile.open(save) as tf:
        entry = json.load(tf.extractfile("manifest.json"))[0]  # type: ignore[arg-type]
    t = time.perf_counter()
    with tarfile.open(save) as tf:
        for i, name in enumerate(entry["Layers"]):
            dest = work / f"l{i}"
            dest.mkdir()
            member = tf.getmember(name)
            while member.issym():
                member = tf.getmember(os.path.normpath(os.path.join(os.path.dirname(name), member.linkname)))
            src = tf.extractfile(member)
            assert src is not None
            proc = subprocess.Popen(["tar", "-x", "-C", str(dest)], stdin=subprocess.PIPE)
            assert proc.stdin is not None
            shutil.copyfileobj(src, proc.stdin, 1 << 20)
            proc.stdin.close()
            assert proc.wait() == 0
    return time.perf_counter() - t


async def imports(tag: str, reps: int, tmp: Path) -> dict[str, object]:
    save = tmp / "save.tar"
    _build.docker("save", "-o", str(save), tag)
    await AiodockerEngine().image_id(tag)  # aiodocker's first import (~1 s) is not an import's cost
    cold_archive, cold_engine, warm_archive, warm_engine, tar_times = [], [], [], [], []
    size = 0
    for i in range(reps):
        store = LayerStore(tmp / f"cold{i}")
        t = time.perf_counter()
        image = await Image.from_docker_archive(save, store=store)
        cold_archive.append(time.perf_counter() - t)
        size = disk_bytes(store.root)
        # warm: every layer is stored, only the record is missing (another image with the same layers)
        store.record_path(image.digest).unlink()
        t = time.perf_counter()
        await Image.from_docker_archive(save, store=store)
        warm_archive.append(time.perf_counter() - t)
        t = time.perf_counter()
        await Image.from_docker(tag, store=store)  # the record is there: an inspect, nothing exported
        warm_engine.append(time.perf_counter() - t)
        shutil.rmtree(store.root)
        store = LayerStore(tmp / f"engine{i}")
        t = time.perf_counter()
        await Image.from_docker(tag, store=store)  # docker save through aiodocker, then the cold import
        cold_engine.append(time.perf_counter() - t)
        shutil.rmtree(store.root)
        work = tmp / f"tar{i}"
        work.mkdir()
        tar_times.append(await anyio.to_thread.run_sync(tar_baseline, save, work))
        shutil.rmtree(work)
    cold = summary(cold_archive)
    return {
        "image": tag,
        "layers": len(image.layers),
        "archive_mib": round(save.stat().st_size / 2**20, 1),
        "stored_disk_mib": round(size / 2**20, 1),
        "cold_from_docker_archive_ms": cold,
        "cold_from_docker_engine_ms": summary(cold_engine),
        "warm_layers_stored_from_archive_ms": summary(warm_archive),
        "warm_image_stored_from_engine_ms": summary(warm_engine),
        "gnu_tar_unpack_ms": summary(tar_times),
        "cold_vs_gnu_tar": round(cold["median"] / summary(tar_times)["median"], 2),
    }


async def first_exec(image: Image | None, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        ws = Workspace(image)
        await ws.start()
        await ws.exec(["true"])
        out.append(time.perf_counter() - t)
        await ws.aclose()
    return out


async def starts(imported: Image, n: int) -> dict[str, object]:
    await first_exec(imported, 2)  # page cache and agent layer warm for both
    await first_exec(None, 2)
    a: list[float] = []
    b: list[float] = []
    for _ in range(n):  # interleaved, so load on the shared machine hits both alike
        a += await first_exec(imported, 1)
        b += await first_exec(None, 1)
    sa, sb = summary(a), summary(b)
    return {
        "imported_image": sa,
        "built_in_base_image": sb,
        "ratio_median": round(sa["median"] / sb["median"], 3),
        "imported_layers": len(imported.layers),
    }


async def sharing(tags: list[str], tmp: Path) -> dict[str, object]:
    store = LayerStore(tmp / "shared")
    images = [await Image.from_docker(tag, store=store) for tag in tags]
    separate = 0
    for image in images:
        separate += sum(disk_bytes(Path(p).parent) for p in image.layers)
    together = disk_bytes(store.layers)
    base = Path(images[0].layers[-1]).parent
    assert all(Path(i.layers[-1]).parent == base for i in images), "the images do not share their base layer"
    out = {
        "images": tags,
        "layers": [len(i.layers) for i in images],
        "store_disk_mib": round(together / 2**20, 1),
        "if_stored_separately_mib": round(separate / 2**20, 1),
        "shared_base_layer_mib": round(disk_bytes(base) / 2**20, 1),
        "saved_mib": round((separate - together) / 2**20, 1),
    }
    shutil.rmtree(store.root)
    return out


async def main() -> None:
    reps = int(os.environ.get("BENCH_REPS", "3"))
    base = _build.bookworm()
    tag = _build.build("layers", base)  # the base (~300 MB) and two layers that delete and replace files
    other = _build.build("user", base)
    tmp = Path(tempfile.mkdtemp(prefix="bunshin-image-bench-", dir="/var/tmp"))
    try:
        result: dict[str, object] = {
            "benchmark": "image",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
            "import": await imports(tag, reps, tmp),
        }
        store = LayerStore(tmp / "starts")
        imported = await Image.from_docker(tag, store=store)
        result["create_to_first_exec_ms"] = await starts(imported, reps * 10)
        result["two_images_sharing_a_base_layer"] = await sharing([tag, other], tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    anyio.run(main)
