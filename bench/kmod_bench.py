"""Template fork through the kernel module (kmod/, issue #21), measured inside the qemu guest that runs the pinned
Debian kernel (kmod/run-vm.sh bench): for each template size (``--sizes``, default 64 and 256 MiB) the module's
costs beside a page-image fork's, all in one guest run, medians of 5 (kmod/tests/tmpl_test.c ``bench``).

- ``kmod_create_ms``: BUNSHIN_TMPL_CREATE, pinning the frozen template's pages (once per snapshot);
- ``kmod_map_ms``: a copy's mmap of the template fd (per copy; page tables fill on first touch);
- ``kmod_prefill_map_ms``: the same with BUNSHIN_TMPL_F_PREFILL (every PTE inserted at mmap time);
- ``kmod_first_read_ms``: a copy reading one word of every page after a lazy map (the faults it pays on use);
- ``image_dump_ms``: copying the template's pages into a page image on tmpfs, what a CRIU dump costs (once per
  snapshot), ``image_cow_map_ms``: mapping that image MAP_PRIVATE as criu-cow's restore does (per copy), and
  ``image_copy_restore_ms``: reading it into anonymous memory as a stock restore does (per copy).

The guest is emulated (TCG), so only ratios mean anything: ``ratio_*`` are the largest size over the smallest
(1.0 = cost independent of memory, ``ratio_sizes`` = proportional), and ``image_cow_over_kmod_*`` a criu-cow-like
fork (dump + image map) over a module fork (pin + map) at the same size.

A second guest run (kmod/run-vm.sh criu-bench, ``--criu-sizes``, default 32 and 128 MiB, issue #21's 200 and 800;
empty to skip) times the project's CRIU on a two-task tree (kmod/tests/criu_test.c ``bench``), per size:

- dumps, medians of 5: plain (``dump_full_ms``) beside a template dump without the anonymous pages
  (``dump_tmpl_ms``, CRIU_TMPL_DUMP, criu/patches/0012; ``*_pages_bytes``: what each wrote);
- a copy's restore four ways, interleaved, medians of 5: through the module pinning its own templates (``tmpl``;
  ``tmpl_pin_ms`` the part spent pinning), through the module with templates made once for the snapshot
  (``given``, CRIU_TMPL_FDS; ``given_made_ms`` what making them took, once), CRIU's CoW restore of the plain dump's
  page image (``cow``) and a plain restore reading it (``plain``);
- ``first_fork_*``: dump + restore, template dump + ``given`` against plain dump + ``cow``;
- ``fan_*``: 8 copies alive at once, templates made once against CoW (the sum of criu's times; medians of 2);
- ``nested_*``: a fork of a fork, medians of 3: a copy that wrote 8 MiB, forked by a template dump and a restore
  through the module (``nested_tmpl_made_ms``: its templates, made once) against an incremental dump of a CoW copy
  (criu/patches/0002) and its CoW restore;
- ``largest_over_smallest``: each of those at the largest size over the smallest (1.0 = cost independent of
  memory; ``sizes_ratio`` = proportional).

The times are criu's own (its log's last time stamp: exec and dynamic linking, seconds under TCG, are left out; the
``*_wall_ms`` keep them). Prints JSON; never fails because the machine is slow.

    .venv/bin/python bench/kmod_bench.py [--sizes 64,256] [--criu-sizes 32,128]   (issue #21's: --sizes 200,800)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

RUN_VM = Path(__file__).resolve().parent.parent / "kmod" / "run-vm.sh"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256", help="comma-separated template sizes in MiB (smallest first)")
    ap.add_argument("--criu-sizes", default="32,128", help="sizes for the CRIU restore run (empty: skip it)")
    ap.add_argument("--timeout", type=int, default=400, help="seconds the guest may run")
    args = ap.parse_args()
    sizes = [str(int(s)) for s in args.sizes.split(",")]
    out = _guest("bench", sizes, args.timeout)
    if args.criu_sizes:
        out["criu_restore"] = _guest("criu-bench", [str(int(s)) for s in args.criu_sizes.split(",")], args.timeout)
    print(json.dumps(out, indent=1))


def _guest(job: str, sizes: list[str], timeout: int) -> dict[str, object]:
    start = time.monotonic()
    res = subprocess.run(
        [str(RUN_VM), job, *sizes],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout + 120,
        stdin=subprocess.DEVNULL,
        # The guest holds the largest template, its page image on tmpfs and a restored copy (CoW copies too) at once.
        env={
            **os.environ,
            "BUNSHIN_KMOD_TIMEOUT": str(timeout),
            "BUNSHIN_KMOD_MEM": str(max(2048, 5 * max(int(s) for s in sizes) + 1024)),
        },
    )
    console = res.stdout.replace("\r", "")
    result = next(
        (
            json.loads(line.split(" ", 1)[1])
            for line in reversed(console.splitlines())
            if line.startswith("BUNSHIN_KMOD_RESULT ")
        ),
        None,
    )
    out: dict[str, object] = {
        "benchmark": "kmod-template-fork" if job == "bench" else "kmod-criu-template-restore",
        "date": time.strftime("%Y-%m-%d"),
        "host": "guest under qemu TCG (software emulation) on a shared host: ratios only",
        "wall_s": round(time.monotonic() - start, 1),
        "harness_rc": res.returncode,
    }
    if result is None:
        out["error"] = f"no result line from the guest (exit {res.returncode}): {res.stderr.strip()[-500:]}"
    else:
        out.update(
            kernel=result["kernel"],
            accel=result["accel"],
            module_unloaded=result["module_gone"],
            kernel_bad_lines=result["kernel_bad_lines"],
            **(result["test"] or {"error": "the guest job printed nothing"}),
        )
    return out


if __name__ == "__main__":
    main()
