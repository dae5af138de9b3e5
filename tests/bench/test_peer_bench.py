"""The peer benchmark in its quick mode, so that it cannot rot: every peer of every row has a figure or the
recorded reason it failed."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import psutil
import pytest

from ._quick import quick_run

DOCKER_TMPDIR = Path("/var/lib/bunshin-docker/tmp")  # scripts/docker.sh's default

ROWS = {
    "create_to_first_exec": ("bunshin", "docker", "podman", "bwrap"),
    "exec_round_trip": ("bunshin", "docker", "docker_api", "podman"),
    "live_fork": ("bunshin", "docker", "podman", "bwrap"),
    "idle_memory": ("bunshin", "docker", "podman", "bwrap"),
    "concurrent_creations": ("bunshin", "docker", "podman", "bwrap"),
}


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(900)
def test_quick_run_reports_every_peer(tmp_path: Path) -> None:
    tmp_checkpoints = set(Path("/tmp").glob("ctrd-checkpoint*"))
    out = quick_run("peer_bench.py", tmp_path, timeout=880)
    for row, peers in ROWS.items():
        for peer in peers:
            fig = out[row][peer]
            assert fig, (row, peer)
            if "failed" in fig:
                assert isinstance(fig["failed"], str) and fig["failed"], (row, peer, fig)
            elif row == "live_fork":
                for n in ("1", "2"):
                    assert fig[n]["ms"] > 0 and fig[n]["total_pss_mib"] > 0, (row, peer, fig)
            else:
                assert fig["median"] > 0, (row, peer, fig)
    # Bunshin itself must never be a failed row: it is what the others are compared with.
    for row in ROWS:
        assert "failed" not in out[row]["bunshin"], out[row]["bunshin"]
    # Copy-on-write: two copies of a workspace holding ``mib`` MiB of state together hold less than one private copy.
    assert out["live_fork"]["bunshin"]["2"]["total_pss_mib"] < out["mib"]
    # Nothing the run started is left in either engine (failed steps included). Only this run's label: another
    # run on the machine (or one killed before it could clean up) is not this run's leftover.
    label = f"label={out['run_label']}"
    for cli in (["/usr/bin/docker"], ["podman"]):
        ps = subprocess.run([*cli, "ps", "-aq", "--filter", label], capture_output=True, text=True)
        assert ps.returncode == 0 and ps.stdout.split() == [], (cli, ps.stdout, ps.stderr)
    # Nor the CRIU images of its docker checkpoints, which containerd 1.6 leaves in its temporary directory
    # (containerd#10166): scripts/docker.sh gives the daemon its own, which the benchmark empties.
    assert not list(DOCKER_TMPDIR.glob("ctrd-checkpoint*"))
    if daemon_tmpdir() == str(DOCKER_TMPDIR):
        assert set(Path("/tmp").glob("ctrd-checkpoint*")) <= tmp_checkpoints


def daemon_tmpdir() -> str | None:
    """The temporary directory of the running Docker daemon (its containerd inherits it)."""
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "dockerd":
            with contextlib.suppress(psutil.Error):
                return proc.environ().get("TMPDIR")
    return None
