"""``python -m tests.bench.accounting_check [--out FILE] [--interval S] -- <python -m bench.experiment arguments>``
(root, from the checkout's root): runs the experiment in this process with those arguments (its own parser: they mean
exactly what they mean to ``bench.experiment``), with ``_sampler.Sampler`` reading the same cgroups and snapshots
beside it, and prints per configuration (and repeat) the experiment's GiB·s, peak MiB and CPU seconds against the
sampler's, with the relative difference. Exit status 1 when a figure differs by more than 5% (issue #32's acceptance).

The run gets a cgroup parent, snapshot store and workspace directory of its own (``BUNSHIN_CGROUP_PARENT``,
``BUNSHIN_SNAPDIR``, ``BUNSHIN_RUNDIR``), so the sampler sees this run only; they are removed afterwards, also on
Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from ._sampler import TOLERANCE, Figure, Result, Sampler, compare, disagreements

FIGURES = {"GiB·s": 3, "peak MiB": 1, "CPU s": 2}  # each figure's digits, as the experiment rounds it


@contextlib.contextmanager
def own_run() -> Iterator[str]:
    """A cgroup parent, snapshot store (a tmpfs, as ``bunshin snapstore`` makes) and workspace directory of this
    process's own, in the environment while it lasts (the experiment and what it starts read them); yields the
    cgroup parent. Everything is removed on exit: what the run left in its cgroups is killed first (only this run's
    processes live there)."""
    from bunshin_async._config import Config
    from bunshin_async._host._snapstore import prepare_snapshot_store

    pid = os.getpid()
    parent = f"bunshin-check-{pid}"
    home = Config.current().run_dir.parent  # beside the default workspace directory, on the same file system
    rundir = Path(tempfile.mkdtemp(prefix=f"bunshin-check-{pid}-", dir=home if home.is_dir() else None))
    snapdir = Path(tempfile.mkdtemp(prefix=f"bunshin-snap-check-{pid}-", dir="/dev/shm"))
    env = {"BUNSHIN_CGROUP_PARENT": parent, "BUNSHIN_SNAPDIR": str(snapdir), "BUNSHIN_RUNDIR": str(rundir)}
    try:
        with mock.patch.dict(os.environ, env):
            prepare_snapshot_store()
            yield parent
    finally:
        _remove(parent, rundir, snapdir)


def _remove(parent: str, rundir: Path, snapdir: Path) -> None:
    from bunshin_async._host._kernel import CGROUP_ROOT

    roots = [d / parent for d in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()] if (d / parent).is_dir()]
    for attempt in range(50):
        pids = {int(x) for r in roots for d, _, _ in os.walk(r) for x in _read(Path(d, "cgroup.procs")).split()}
        if not pids:
            break
        if attempt == 0:
            print(f"accounting_check: killing {len(pids)} process(es) the run left in {parent}", file=sys.stderr)
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        time.sleep(0.1)
    for r in roots:
        for d, _, _ in os.walk(r, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(d)
    for top in (rundir, snapdir):
        mounts = [m for m in _mount_points() if m == str(top) or m.startswith(f"{top}/")]
        for m in sorted(mounts, key=len, reverse=True):  # deepest first
            subprocess.run(["umount", "--lazy", m], check=False)
        shutil.rmtree(top, ignore_errors=True)
    left = [str(r) for r in roots if r.exists()] + [str(t) for t in (rundir, snapdir) if t.exists()]
    if left:
        print(f"accounting_check: could not remove {left}", file=sys.stderr)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _mount_points() -> list[str]:
    """This mount namespace's mount points (``/proc/self/mountinfo``'s fifth field, octal escapes decoded)."""
    points = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        field = line.split()[4]
        points.append(field.encode().decode("unicode_escape"))
    return points


def _cell(f: Figure) -> str:
    n = FIGURES[f.what]
    return f"{f.experiment:.{n}f} / {f.independent:.{n}f} ({f.difference:+.1%})"


def table(figures: list[Figure]) -> str:
    """One row per configuration (and repeat): each figure as experiment / independent (relative difference)."""
    rows = ["| configuration | " + " | ".join(FIGURES) + " |", "|---" * (len(FIGURES) + 1) + "|"]
    by_label: dict[str, dict[str, Figure]] = {}
    for f in figures:
        by_label.setdefault(f.label, {})[f.what] = f
    for label, fs in by_label.items():
        rows.append(f"| {label} | " + " | ".join(_cell(fs[w]) for w in FIGURES) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, experiment_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.accounting_check", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    parser.add_argument("--interval", type=float, default=0.1, help="the sampler's spacing (seconds)")
    args = parser.parse_args(ours)
    if os.geteuid() != 0:
        print("accounting_check: needs root (as the experiment does)", file=sys.stderr)
        return 2
    # By name: mypy checks bench/experiment as its own top-level package (bench has no __init__.py).
    experiment = importlib.import_module("bench.experiment").main

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up as Ctrl-C does
    results: list[Result] = []
    started, load_before = time.time(), os.getloadavg()
    try:
        with own_run() as parent, Sampler(interval=args.interval) as sampler:
            print(f"accounting_check: cgroup parent {parent}, snapshot store {sampler.store}", flush=True)

            def progress(line: str) -> None:
                sampler.progress(line)
                print(line, flush=True)

            rc = experiment(experiment_args, progress=progress, on_result=results.append)
    except KeyboardInterrupt:
        print("accounting_check: interrupted", file=sys.stderr)
        return 130
    if rc or not results:
        return rc or 1
    figures = compare(results[0], sampler)
    wrong = disagreements(figures)
    print(f"\nexperiment / independent sampler (relative difference); tolerance {TOLERANCE:.0%}:\n")
    print(table(figures))
    print(f"\nagree within {TOLERANCE:.0%}: {'no' if wrong else 'yes'}", *(f"  {w}" for w in wrong), sep="\n")
    if args.out:
        report: dict[str, Any] = {
            "experiment_args": experiment_args,
            "interval_s": args.interval,
            "tolerance": TOLERANCE,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "figures": [{**f._asdict(), "difference": f.difference} for f in figures],
            "disagreements": wrong,
            "agree": not wrong,
        }
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        print("written:", args.out)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
