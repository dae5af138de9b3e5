"""The commit a benchmark record names (``bench.report.git_commit``): ``+changes`` where the tree's code differs from
its commit, not where only results differ (``report.py run`` of several benchmarks writes each one's tracked record
into bench/results before the next one runs, so the second record of a run named its own commit "+changes")."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import report

pytestmark = pytest.mark.unit


def test_a_record_written_before_is_no_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    results, code = tmp_path / "bench" / "results", tmp_path / "bench" / "fork_bench.py"
    results.mkdir(parents=True)
    (results / "workspace.record.json").write_text("{}\n")
    code.write_text("x = 1\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "x")
    head = git("rev-parse", "--short=10", "HEAD").strip()
    monkeypatch.setattr(report, "ROOT", tmp_path)
    assert report.git_commit() == head
    (results / "workspace.record.json").write_text('{"median": 8.69}\n')  # the run's first benchmark's record
    assert report.git_commit() == head
    code.write_text("x = 2\n")
    assert report.git_commit() == f"{head}+changes"
