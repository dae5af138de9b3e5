"""Bunshin as a user gets it: the wheel (``python -m build``, from the sdist) installed into a fresh virtual
environment outside the checkout, run from another directory. It must find the host's CRIU through host.toml (the
set-up ran), fork live (every copy ``criu-cow``, the README quickstart's background server carried, not
restarted), and, with CRIU hidden, refuse to fork rather than fork less, unless ``fork_mode="fs"`` is asked for."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

HARNESS = """\
import json, sys
import bunshin_async
from bunshin_async import Workspace
from bunshin_async._host import _paths

GET = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/')"
SERVER = (  # waits for the server to answer, then names its pid
    f"for i in $(seq 400); do python3 -c \\"{GET}\\" 2>/dev/null && exec pgrep -f 'http.server 8000'; "
    "sleep 0.05; done; exit 1"
)
seen = []
real_fork = Workspace.fork


async def fork(self, n=1):  # observes the quickstart's fork: what each copy is and whether its server is the parent's
    parent = (await self.exec("pgrep -f 'http.server 8000'", timeout=10)).stdout.split()
    copies = await real_fork(self, n)
    for c in copies:
        r = await c.exec(SERVER, timeout=60)
        restarted = [p.step.argv for p in c.restarted_processes]
        seen.append({"mode": c.fork_mode, "server": r.stdout.split(), "parent": parent, "restarted": restarted})
    return copies


Workspace.fork = fork
code = open(sys.argv[1]).read()
exec(compile(code, "README.md (Quickstart)", "exec"), {"__name__": "__main__"})
result = {"package": bunshin_async.__file__, "criu": str(_paths.criu_binary()), "forks": seen}
json.dump(result, open(sys.argv[2], "w"))
"""

HIDDEN = """\
import anyio
from bunshin_async import CapabilityMissing, Config, Workspace


async def main():
    async with Workspace() as ws:
        await ws.spawn("sleep 1000")
        try:
            await ws.fork(2)
        except CapabilityMissing as exc:
            print("raised:", exc.capability, "|", exc.remedy)
        else:
            raise SystemExit("fork(2) did not raise with CRIU hidden")
        Config.configure(fork_mode="fs")
        copies = await ws.fork(2)
        print("modes:", *[c.fork_mode for c in copies])
        for c in copies:
            await c.aclose()


anyio.run(main)
"""


def quickstart() -> str:
    """The Python block of README.md's Quickstart section."""
    section = (ROOT / "README.md").read_text().split("\n## Quickstart", 1)[1]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


@pytest.fixture(scope="module")
def user_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment (the base interpreter of this one) with the wheel and its dependencies."""
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (out / "dist").glob("*.whl")
    assert wheel.name.endswith("-cp310-abi3-linux_x86_64.whl")  # one wheel for Python 3.10-3.13
    env = out / "env"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", str(env)], check=True, env=_user_environ(), cwd=out)
    pip = subprocess.run(
        [str(env / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        env=_user_environ(),  # without PYTHONPATH, pip would take the checkout for an installed bunshin
        cwd=out,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    yield env


def _names_checkout(path: Path) -> bool:
    """Whether a file holds an absolute path into the checkout (``<ROOT>/...`` starting a path, not the tail of
    another one: in the clean-root check the checkout is ``/src``, which ``$BUILD/src/criu`` also contains)."""
    return re.search(rb"(?<![\w.$/-])" + re.escape(str(ROOT).encode()) + rb"/", path.read_bytes()) is not None


def _user_environ(**extra: str) -> dict[str, str]:
    """This process's environment (the test run's own workspace, snapshot and cgroup dirs) without anything that
    would point the package at the checkout or choose its mode."""
    drop = {"PYTHONPATH", "VIRTUAL_ENV", "BUNSHIN_CRIU", "BUNSHIN_FORK_MODE", "BUNSHIN_HOST_CONFIG"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def test_the_installed_package_holds_what_it_runs_on(user_env: Path) -> None:
    site = next((user_env / "lib").glob("python3.*/site-packages"))
    pkg = site / "bunshin_async"
    for name in ("bunshin-init", "bunshin-agent", "system-packages.txt", "_criu_build/build.sh"):
        assert (pkg / name).is_file(), name
    assert os.access(pkg / "bunshin-agent", os.X_OK) and list(pkg.glob("_native.abi3.so"))
    assert (site / "speculator" / "ngram-swebench.json.gz").is_file()
    leaks = [p for top in (pkg, site / "speculator") for p in top.rglob("*") if p.is_file() and _names_checkout(p)]
    assert not leaks, f"paths into the checkout: {leaks}"
    doctor = subprocess.run(
        [str(user_env / "bin" / "bunshin"), "doctor"], capture_output=True, text=True, env=_user_environ(), cwd="/"
    )
    assert doctor.returncode == 0, doctor.stdout
    for row in ("ok   criu ", "ok   host set-up ", "ok   fork mode ", "ok   bunshin-init "):
        assert row in doctor.stdout, doctor.stdout
    setup = subprocess.run(
        [str(user_env / "bin" / "python"), "-m", "bunshin_async", "setup", "--help"],
        capture_output=True,
        text=True,
        env=_user_environ(),
        cwd="/",
    )
    assert setup.returncode == 0 and "--no-images" in setup.stdout


def test_readme_quickstart_forks_live(user_env: Path, tmp_path: Path) -> None:
    (tmp_path / "quickstart.py").write_text(quickstart())
    (tmp_path / "harness.py").write_text(HARNESS)
    run = subprocess.run(
        [str(user_env / "bin" / "python"), "harness.py", "quickstart.py", "result.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_user_environ(),
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["package"].startswith(str(user_env)), result
    assert not result["criu"].startswith(str(ROOT)), result  # the host's install, found through host.toml
    forks = result["forks"]
    assert len(forks) == 4, forks
    for copy in forks:
        assert copy["mode"] == "criu-cow", copy
        assert copy["restarted"] == [] and copy["parent"] and copy["server"] == copy["parent"], copy  # carried
    assert run.stdout.count("criu-cow hello") == 4, run.stdout


def test_hidden_criu_refuses_to_fork_unless_fs_is_asked(user_env: Path, tmp_path: Path) -> None:
    (tmp_path / "hidden.py").write_text(HIDDEN)
    run = subprocess.run(
        [str(user_env / "bin" / "python"), "hidden.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_user_environ(BUNSHIN_CRIU=str(tmp_path / "no-criu-here")),
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "raised: criu | run `sudo bunshin setup`" in run.stdout, run.stdout
    assert "modes: fs fs" in run.stdout, run.stdout
