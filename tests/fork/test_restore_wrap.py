"""``bunshin-init --restore-wrap`` (``_fork._restore._wrapper``), the process every CRIU restore runs through: it
must build the restore's private namespaces and root exactly, leave nothing on the host, and fail loudly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bunshin_async import _paths

pytestmark = pytest.mark.fork_modes("criu-cow")  # no restore mode involved: run once

PROBE = (
    "readlink /proc/self/fd/9 /proc/self/ns/net; grep -c ' {root} ' /proc/self/mountinfo; cat {root}/hello; "
    "ip -o link show | cut -d' ' -f2,3"
)


def _dirs(tmp_path: Path) -> dict[str, Path]:
    d = {name: tmp_path / name for name in ("lower", "upper", "work", "root")}
    for p in d.values():
        p.mkdir()
    (d["lower"] / "hello").write_text("from-lower\n")
    return d


def _wrap(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_paths.init_binary()), "--restore-wrap", *args], capture_output=True, text=True, timeout=30
    )


def test_private_mount_and_fresh_net(tmp_path: Path) -> None:
    d = _dirs(tmp_path)
    opts = f"lowerdir={d['lower']},upperdir={d['upper']},workdir={d['work']}"
    r = _wrap("--net", "--overlay", opts, "--root", str(d["root"]), "--", "/bin/sh", "-c", PROBE.format(root=d["root"]))
    assert r.returncode == 0, r.stderr
    fd9, own_net, mounted, hello, *links = r.stdout.split()
    assert fd9 == own_net != os.readlink("/proc/self/ns/net")  # CRIU inherits the new namespace on fd 9
    assert (mounted, hello) == ("1", "from-lower")
    assert links[0] == "lo:" and "UP" in links[1].split(",") and len(links) == 2  # loopback only, up
    assert not os.listdir(d["root"])  # the overlay lived only in the wrapper's mount namespace
    assert f" {d['root']} " not in Path("/proc/self/mountinfo").read_text()


def test_without_net_keeps_the_callers_namespace(tmp_path: Path) -> None:
    d = _dirs(tmp_path)
    opts = f"lowerdir={d['lower']},upperdir={d['upper']},workdir={d['work']}"
    r = _wrap("--overlay", opts, "--root", str(d["root"]), "--", "/bin/readlink", "/proc/self/ns/net")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == os.readlink("/proc/self/ns/net")


def test_failures_are_reported_on_stderr(tmp_path: Path) -> None:
    d = _dirs(tmp_path)
    r = _wrap("--overlay", f"lowerdir={tmp_path}/missing", "--root", str(d["root"]), "--", "/bin/true")
    assert r.returncode == 1 and r.stderr.startswith("E mount overlay on "), r.stderr
    opts = f"lowerdir={d['lower']},upperdir={d['upper']},workdir={d['work']}"
    r = _wrap("--overlay", opts, "--root", str(d["root"]), "--", str(tmp_path / "no-such-criu"))
    assert r.returncode == 1 and "no-such-criu: No such file or directory" in r.stderr
    r = _wrap("--cgroup", str(tmp_path / "no-cgroup"), "--overlay", opts, "--root", str(d["root"]), "--", "/bin/true")
    assert r.returncode == 1 and "no-cgroup: No such file or directory" in r.stderr
    for bad in ([], ["--overlay", opts, "--root", str(d["root"])], ["--bogus", "--", "/bin/true"]):
        r = _wrap(*bad)
        assert r.returncode == 1 and "usage: bunshin-init --restore-wrap" in r.stderr
    assert not os.listdir(d["root"])
