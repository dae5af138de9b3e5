"""Where a CRIU dump's time goes, phase by phase, from its log at level 3 (``BUNSHIN_CRIU_LOG_LEVEL=3``), issue 39.

Each log line is timestamped; the time from a line to the next goes to the phase the line is in, and a phase starts at
the first line matching its marker (in the order below; per process, the process's own markers). Prints JSON: per
phase the median and range over the logs given, and the median log span. CRIU's log starts when CRIU does and it
waits for the request before the first phase (``Will dump``), so the span leaves out CRIU's start, as the pause does.

    .venv/bin/python bench/criu_phases.py DUMP_LOG [DUMP_LOG ...]
    .venv/bin/python bench/criu_phases.py --take 8 --mib 200 --out /tmp/logs   # checkpoints of fork_bench's guest
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

TIMESTAMP = re.compile(r"^\((\d+\.\d+)\)\s?(.*)")
# (phase, marker): the phases of a dump in the order CRIU logs them (cr-dump.c, cr_dump_tasks()).
GLOBAL = [
    ("set-up (irmap, cgroup properties, own namespaces, inventory)", r"Will dump/restore TCP"),
    ("freeze", r"cg: Set \d+ is criu one"),
    ("seize, collect the tree", r"Seized task"),
    ("query-ext-files notification", r"net: Lock network"),
    ("collect namespaces (mounts, sockets, pid)", r"RPC NOTIFY query-ext-files"),
    ("pstree, namespaces (UTS, IPC, net)", r"Dumping pstree"),
    ("cgroups, inventory", r"Namespaces dump complete"),
    ("post-dump notification, network unlock", r"Writing image inventory"),
    ("thaw, stats", r"Unfreezing tasks"),
]
TASK = re.compile(r"Dumping task \(pid: \d+ comm: (\S+)\)")
# Within a process: (sub-phase, marker)
PER_TASK = [
    ("maps", r"Dumping task \(pid"),
    ("mapped files", r"Dumping path for -\d+ fd via self \d+ \[/"),
    ("infect (fds list, parasite)", r"Collected, longest area"),
    ("files", r"Dumping opened files"),
    ("pages", r"Dumping pages"),
    ("core, cgroup, mm, cure", r"Dumping core \(pid"),
]


def phases(log: Path) -> tuple[dict[str, float], float]:
    lines = []
    for raw in log.read_text(errors="replace").splitlines():
        m = TIMESTAMP.match(raw)
        if m:
            lines.append((float(m[1]), m[2]))
    out: dict[str, float] = {}
    phase = "CRIU start, waiting for the request"
    task = ""
    sub = 0
    nxt = 0
    start = None
    for (t, msg), (t2, _) in zip(lines, lines[1:], strict=False):
        if nxt < len(GLOBAL) and re.search(GLOBAL[nxt][1], msg):
            phase, task = GLOBAL[nxt][0], ""
            nxt += 1
            if start is None:
                start = t
        m = TASK.search(msg)
        if m:
            task, sub = m[1], 0
        if task and sub < len(PER_TASK) and re.search(PER_TASK[sub][1], msg):
            phase = f"{task}: {PER_TASK[sub][0]}"
            sub += 1
        if task and re.search(r"Dumping pstree", msg):
            task = ""
        out[phase] = out.get(phase, 0.0) + (t2 - t) * 1000
    span = (lines[-1][0] - (start if start is not None else lines[0][0])) * 1000
    out.pop("CRIU start, waiting for the request", None)
    return out, span


PAGES_OF = re.compile(r"Pages of \d+: (\d+) us: (.*)")
PAGES_PART = re.compile(r"([a-z][a-z ]*?) (\d+) us")


def pages_of(log: Path) -> dict[str, float]:
    """The largest process's page dump, part by part (ms), from CRIU's ``Pages of PID`` line (criu/patches/0022):
    the parent pagemap read and freed, the page scans, the page pipe's iovs, the parasite's vmsplice calls, the
    pagemap entries and the splice into the pages image, the parasite's mprotects and the arming."""
    best: dict[str, float] = {}
    for m in PAGES_OF.finditer(log.read_text(errors="replace")):
        parts = {"all": int(m[1]) / 1000}
        for name, us in PAGES_PART.findall(m[2]):
            parts[name.strip()] = int(us) / 1000
        if parts["all"] > best.get("all", -1.0):
            best = parts
    if "xfer" in best and "splice" in best:
        best["xfer without splice"] = round(best["xfer"] - best["splice"], 3)
    return best


def summary(logs: list[Path]) -> dict[str, object]:
    per = [phases(p) for p in logs]
    names: list[str] = []
    for d, _ in per:
        names += [k for k in d if k not in names]
    rows = {}
    for k in names:
        xs = [d.get(k, 0.0) for d, _ in per]
        rows[k] = {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}
    spans = [s for _, s in per]
    out: dict[str, object] = {"logs": len(logs), "span_ms": round(statistics.median(spans), 2), "phases_ms": rows}
    pages = [d for d in (pages_of(p) for p in logs) if d]
    if pages:
        out["largest_pages_ms"] = {
            k: {"median": round(statistics.median(d.get(k, 0.0) for d in pages), 3)}
            | {"min": round(min(d.get(k, 0.0) for d in pages), 3), "max": round(max(d.get(k, 0.0) for d in pages), 3)}
            for k in pages[0]
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="*", type=Path)
    ap.add_argument("--take", type=int, default=0, help="take this many checkpoints of fork_bench's guest first")
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--dirty-mib", type=int, default=8)
    ap.add_argument("--mode", default="cow+track", help="as fork_bench's --modes (MODE@CRIU)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/criu-phases"))
    args = ap.parse_args()
    logs = list(args.logs)
    if args.take:
        logs += take(args.take, args.mib, args.dirty_mib, args.mode, args.out)
    if not logs:
        sys.exit("no logs")
    print(json.dumps(summary(logs), indent=1))


def take(n: int, mib: int, dirty_mib: int, mode: str, out: Path) -> list[Path]:
    """``n`` checkpoints after a first one of fork_bench's guest, each after ``dirty_mib`` MiB dirtied; their logs."""
    import os
    import shutil

    import anyio

    os.environ["BUNSHIN_CRIU_LOG_LEVEL"] = "3"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fork_bench as fb

    from bunshin_async import Snapshot
    from bunshin_async._fork._snapshot import record_of

    out.mkdir(parents=True, exist_ok=True)
    logs: list[Path] = []

    async def run() -> None:
        _, track = fb._use_mode(mode)
        ws, _ = await fb._with_state(mib)
        last: Snapshot | None = None
        try:
            await fb._http(ws, "/dirty/0")
            for i in range(n + 1):
                await fb._http(ws, f"/dirty/{dirty_mib}")
                snap, row = await fb._checkpoint(ws, track)
                if i:
                    logs.append(out / f"dump-{i}.log")
                    shutil.copy(record_of(snap).images / "dump.log", logs[-1])
                    print(f"checkpoint {i}: pause {row['pause']:.1f} ms", file=sys.stderr)
                if last is not None:
                    await last.aclose()
                last = snap
        finally:
            if last is not None:
                await last.aclose()
            await ws.aclose()

    anyio.run(run)
    return logs


if __name__ == "__main__":
    main()
