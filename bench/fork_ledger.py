"""Where a speculative configuration's GiB·s go, fork by fork (issue #38: the oracle, under the GiB·s launch rule,
held 1.22x fork+cache's GiB·s): the experiment (``python -m bench.experiment``, same arguments) run with a ledger.

Beside every sample of the experiment's sampler (``Subtree.read``, every 0.1 s) the ledger reads the same subtree
broken down: each process's PSS by its workspace's cgroup (``ws-<id>``) and whether it is CRIU's (``comm`` criu:
a dump's or restore's own processes), each workspace's upper dir, the run's snapshot directory (its tmpfs's count)
and the page images mapped beyond their PSS. Beside every speculative fork it records, from the runtime: when its
fork started and ended, its workspace's id, what the launch rule's terms were when it was launched
(``MemoryTerms``: ``held`` bytes for ``hold`` seconds, ``miss``, ``lasting``, ``freed``), and when it was settled
(committed or discarded). ``--ledger FILE`` (JSON lines) keeps all that; the summary printed at the end integrates,
per configuration, each class of bytes over the run (GiB·s): speculative forks until settled (their cgroup's PSS
and upper), rollouts' workspaces, CRIU's processes, the snapshot directory, mapped images; and per fork, the rule's
``held x hold`` against what its cgroup held from its fork's start to its settling, and to the ask (the rollout
moved into it: ``WorkspaceHandle.move``, or its call ended first: ``commit``).

    .venv/bin/python -m bench.fork_ledger --ledger /tmp/ledger.jsonl -- --trajectories \
        ../shared/traces/terminal-bench-dev.jsonl.gz --limit 200 --group-by task --pad-tools \
        --tasks hf-model-inference --time-scale 0.5 --configs fork+cache,oracle
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from bunshin_async._runtime import _branches
from bunshin_async._workspace import _accounting
from bunshin_async._workspace._accounting import Subtree, Usage

_encoder = msgspec.json.Encoder()
_lock = threading.Lock()
_out: Any = None


def _write(record: dict[str, Any]) -> None:
    with _lock:
        _out.write(_encoder.encode(record) + b"\n")


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def breakdown(sub: Subtree, usage: Usage) -> dict[str, Any]:
    """The subtree now, by workspace and by kind (bytes)."""
    roots = sub.roots()
    by_ws: dict[str, int] = defaultdict(int)
    criu: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for root in roots:
        for d, subdirs, _files in os.walk(root):
            subdirs.sort()
            name = Path(d).name
            ws = name[3:] if name.startswith("ws-") else ("" if d == str(root) else name)
            try:
                pids = [int(x) for x in (Path(d) / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                continue
            for pid in pids:
                if pid in seen:
                    continue
                seen.add(pid)
                pss = _pss(pid)
                if _comm(pid) == "criu":
                    criu[ws] += pss
                else:
                    by_ws[ws] += pss
    uppers = {i: _accounting.written_bytes(sub.workspaces / i) for i in sub.workspace_ids()}
    return {
        "t": time.monotonic(),
        "scope": sub.parent,
        "pss": dict(by_ws),
        "criu": dict(criu),
        "upper": uppers,
        "snap": usage.snapshot_bytes,
        "images": usage.image_bytes,
        "total": usage.memory_bytes,
    }


def install() -> None:
    read = Subtree.read

    def read_and_ledger(self: Subtree, extra_dirs: Any = ()) -> Usage:
        u = read(self, extra_dirs)
        rec = breakdown(self, u)
        rec["kind"] = "sample"
        _write(rec)
        return u

    Subtree.read = read_and_ledger  # type: ignore[method-assign]

    from speculator import _policy

    record = _policy.CostAwarePolicy._record

    def record_and_ledger(self: Any, option: Any, verdict: Any, gain: float) -> None:
        record(self, option, verdict, gain)
        if verdict.value == "launch" and option.needs_fork:
            terms = self.memory_terms(option)
            option_terms[id(option)] = msgspec.structs.asdict(terms)

    option_terms: dict[int, dict[str, float]] = {}
    _policy.CostAwarePolicy._record = record_and_ledger  # type: ignore[method-assign]

    ready = _branches.observe_ready

    async def ready_and_ledger(b: Any, rollout: Any) -> None:
        await ready(b, rollout)
        _write({
            "kind": "ready", "t": time.monotonic(), "fork_seconds": b.fork_seconds, "ws": b.ws.directory.name,
            "base": b.base.directory.name if b.base is not None else "", "rollout": b.launch.rollout,
            "call": b.key.name, "terms": option_terms.get(id(b.launch)), "layer": b.layer_bytes,
        })  # fmt: skip

    _branches.observe_ready = ready_and_ledger

    settle = _branches.BranchSet._settle

    async def settle_and_ledger(self: Any, b: Any) -> None:
        ws = b.ws.directory.name if b.forked and b.ws is not None else None
        await settle(self, b)
        if ws is not None:
            _write({"kind": "settle", "t": time.monotonic(), "ws": ws, "committed": b.committed, "used": b.used,
                    "memory_bytes": b.memory_bytes})  # fmt: skip

    _branches.BranchSet._settle = settle_and_ledger  # type: ignore[method-assign]

    from bunshin_async._runtime import _handle

    for name in ("move", "commit"):  # a write's fork becomes the rollout's: the ask (``move``) or its call's end
        original = getattr(_handle.WorkspaceHandle, name)

        def taken(self: Any, workspace: Any, *args: Any, _original: Any = original) -> Any:
            _write({"kind": "taken", "t": time.monotonic(), "ws": workspace.directory.name})
            return _original(self, workspace, *args)

        setattr(_handle.WorkspaceHandle, name, taken)


def summarize(path: Path) -> dict[str, Any]:
    """Per configuration (scope): GiB·s by class, and the launched forks' rule terms against their cgroups."""
    samples: dict[str, list[dict[str, Any]]] = defaultdict(list)
    forks: dict[str, dict[str, Any]] = {}
    for line in path.open("rb"):
        r = msgspec.json.decode(line)
        if r["kind"] == "sample":
            samples[r["scope"]].append(r)
        elif r["kind"] == "ready":
            forks[r["ws"]] = {**r, "start": r["t"] - r["fork_seconds"]}
        elif r["kind"] == "taken" and r["ws"] in forks:
            forks[r["ws"]].setdefault("taken", r["t"])
        elif r["kind"] == "settle" and r["ws"] in forks:
            forks[r["ws"]].update(end=r["t"], committed=r["committed"], miss_bytes=r["memory_bytes"])
    out: dict[str, Any] = {}
    for scope, ss in samples.items():
        ss.sort(key=lambda s: s["t"])
        t0, t1 = ss[0]["t"], ss[-1]["t"]
        mine = {w: f for w, f in forks.items() if t0 <= f["start"] <= t1}

        classes: dict[str, float] = defaultdict(float)
        per_fork: dict[str, float] = defaultdict(float)
        to_ask: dict[str, float] = defaultdict(float)  # from the fork's start to the ask (or its end)
        for a, b in zip(ss, ss[1:], strict=False):
            dt = b["t"] - a["t"]

            def parts(s: dict[str, Any], mine: dict[str, Any] = mine, t1: float = t1) -> dict[str, float]:
                p: dict[str, float] = defaultdict(float)
                for ws, v in s["pss"].items():
                    f = mine.get(ws)
                    live = f is not None and f["start"] <= s["t"] < f.get("end", t1 + 1)
                    p["spec_fork_pss" if live else "workspace_pss"] += v
                for ws, v in s["upper"].items():
                    f = mine.get(ws)
                    live = f is not None and f["start"] <= s["t"] < f.get("end", t1 + 1)
                    p["spec_fork_upper" if live else "workspace_upper"] += v
                p["criu_pss"] = sum(s["criu"].values())
                p["snapshot_dir"] = s["snap"]
                p["mapped_images"] = s["images"]
                p["total"] = s["total"]
                return p

            pa, pb = parts(a), parts(b)
            for k in set(pa) | set(pb):
                classes[k] += (pa.get(k, 0) + pb.get(k, 0)) / 2 * dt
            for ws, f in mine.items():
                if f["start"] <= a["t"] < f.get("end", t1 + 1):
                    va = a["pss"].get(ws, 0) + a["upper"].get(ws, 0) + a["criu"].get(ws, 0)
                    vb = b["pss"].get(ws, 0) + b["upper"].get(ws, 0) + b["criu"].get(ws, 0)
                    per_fork[ws] += (va + vb) / 2 * dt
                    if a["t"] < f.get("taken", f.get("end", t1 + 1)):
                        to_ask[ws] += (va + vb) / 2 * dt
        gib = 1 << 30
        rows = []
        for ws, f in mine.items():
            terms = f.get("terms") or {}
            rows.append({
                "ws": ws, "rollout": f["rollout"], "fork_s": round(f["fork_seconds"], 3),
                "life_s": round(f.get("end", t1) - f["start"], 2), "committed": f.get("committed"),
                "rule_held_kib": round(terms.get("held", 0) / 1024), "rule_hold_s": round(terms.get("hold", 0), 2),
                "rule_held_mib_s": round(terms.get("held", 0) * terms.get("hold", 0) / (1 << 20), 3),
                "rule_lasting_mib_s": round(terms.get("lasting", 0) / (1 << 20), 3),
                "rule_freed_mib_s": round(terms.get("freed", 0) / (1 << 20), 3),
                "measured_mib_s": round(per_fork.get(ws, 0) / (1 << 20), 3),
                "measured_to_ask_mib_s": round(to_ask.get(ws, 0) / (1 << 20), 3),
            })  # fmt: skip
        out[scope] = {
            "seconds": round(t1 - t0, 1),
            "gib_s": {k: round(v / gib, 4) for k, v in sorted(classes.items())},
            "forks": len(rows),
            "rule_held_gib_s": round(sum(r["rule_held_mib_s"] for r in rows) / 1024, 4),
            "rule_lasting_gib_s": round(sum(r["rule_lasting_mib_s"] for r in rows) / 1024, 4),
            "rule_freed_gib_s": round(sum(r["rule_freed_mib_s"] for r in rows) / 1024, 4),
            "measured_forks_gib_s": round(sum(r["measured_mib_s"] for r in rows) / 1024, 4),
            "measured_forks_to_ask_gib_s": round(sum(r["measured_to_ask_mib_s"] for r in rows) / 1024, 4),
            "per_fork": rows,
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ledger", type=Path, required=True, help="JSON lines: samples broken down, forks' lives")
    p.add_argument("--summarize", action="store_true", help="only summarize an existing --ledger")
    p.add_argument("experiment", nargs=argparse.REMAINDER, help="-- then bench.experiment's arguments")
    args = p.parse_args()
    if not args.summarize:
        global _out
        from bench.experiment._cli import add_arguments
        from bench.experiment._cli import main as experiment

        e = argparse.ArgumentParser()
        add_arguments(e)
        rest = args.experiment[1:] if args.experiment[:1] == ["--"] else args.experiment
        with args.ledger.open("wb", buffering=0) as _out:
            install()
            rc = experiment(e.parse_args(rest))
        if rc:
            return rc
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(summarize(args.ledger))).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
