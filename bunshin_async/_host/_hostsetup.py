"""The host part of the set-up, shared by ``bunshin setup`` (an installed package) and ``make setup`` (the checkout,
scripts/setup.sh, which runs this file with the system Python before any virtual environment exists): Debian's
system packages, CRIU 4.2.1 built from criu/patches into ``PREFIX/criu``, and ``/etc/bunshin/host.toml``, which
tells every Bunshin on the host where that CRIU is and which patch set it carries. Idempotent: seconds when done.

Standard library only, no package-relative import: run as a script it must work before the package's
dependencies are installed. What needs the package (the snapshot store, the images) is ``_setup``'s business.

    python3 bunshin_async/_host/_hostsetup.py [--also PKG ...]      (root; Debian 12 or 13)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # the package directory
PREFIX = Path(os.environ.get("BUNSHIN_PREFIX", "/usr/local/lib/bunshin"))
"""Where the host's CRIU is installed (``PREFIX/criu``: sbin/criu, python/pycriu, patchset)."""
HOST_CONFIG = Path("/etc/bunshin/host.toml")
"""The host's record of its set-up (``BUNSHIN_HOST_CONFIG`` moves it), read by ``_paths.host_config``."""
BUILD_CACHE = Path("/var/cache/bunshin/criu")
"""The CRIU source tarball and build tree of an installed package (a checkout keeps them in criu/)."""
SETUP_COMMAND = "sudo bunshin setup"
"""What fixes a host whose set-up is missing or does not match this package."""


def host_config_path() -> Path:
    return Path(os.environ.get("BUNSHIN_HOST_CONFIG", "") or HOST_CONFIG)


def criu_tree() -> Path:
    """criu/ (VERSION, SHA256, patches, build.sh): package data in a wheel (``_criu_build``), the checkout's
    criu/ otherwise."""
    packaged = HERE / "_criu_build"
    return packaged if (packaged / "build.sh").is_file() else HERE.parent / "criu"


def patch_set(tree: Path | None = None) -> str:
    """The digest of the CRIU patch set (VERSION, SHA256, series, the listed patches), as criu/build.sh writes it to
    ``<dist>/patchset``: equal digests, same CRIU."""
    tree = tree or criu_tree()
    h = hashlib.sha256()
    series = (tree / "patches" / "series").read_bytes()
    for name in ("VERSION", "SHA256"):
        h.update((tree / name).read_bytes())
    h.update(series)
    for line in series.decode().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            h.update((tree / "patches" / name).read_bytes())
    return h.hexdigest()[:16]


def parse_toml(text: str) -> dict[str, dict[str, str]]:
    """host.toml as ``{section: {key: value}}`` (top-level keys under ``""``): ``tomllib`` from Python 3.11, else
    the subset Bunshin writes: ``[section]`` and ``key = "string"`` lines, ``#`` comments. Raises ``ValueError``."""
    if sys.version_info >= (3, 11):
        import tomllib

        data = tomllib.loads(text)
        out = {"": {k: str(v) for k, v in data.items() if not isinstance(v, dict)}}
        out.update({k: {kk: str(vv) for kk, vv in v.items()} for k, v in data.items() if isinstance(v, dict)})
        return out
    return parse_toml_subset(text)


def parse_toml_subset(text: str) -> dict[str, dict[str, str]]:
    """The TOML Bunshin writes, read without tomllib (Python 3.10). Raises ``ValueError`` on anything else."""
    out: dict[str, dict[str, str]] = {"": {}}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            out.setdefault(section, {})
            continue
        key, sep, value = line.partition("=")
        value = value.strip()
        if not sep or len(value) < 2 or value[0] != '"' or value[-1] != '"':
            raise ValueError(f"host.toml: cannot read {raw!r}")
        out[section][key.strip()] = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return out


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_host_config(**sections: dict[str, str]) -> bool:
    """Merge ``sections`` into host.toml (atomically; untouched when nothing changes). Returns whether it changed."""
    path = host_config_path()
    try:
        data = parse_toml(path.read_text())
    except (OSError, ValueError):
        data = {"": {}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    lines = ["# The host's Bunshin set-up, written by `bunshin setup` (and `make setup`); read by every Bunshin on it."]
    lines += [f"{k} = {_quote(v)}" for k, v in sorted(data.get("", {}).items())]
    for name in sorted(n for n in data if n):
        lines += ["", f"[{name}]", *(f"{k} = {_quote(v)}" for k, v in sorted(data[name].items()))]
    text = "\n".join(lines) + "\n"
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(0o644)
    tmp.replace(path)
    return True


def log(message: str) -> None:
    print(f"==> {message}", flush=True)


def system_packages() -> list[str]:
    """The packages of system-packages.txt (which ``bunshin doctor`` reads too)."""
    text = (HERE / "system-packages.txt").read_text()
    return [line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")]


def install_packages(extra: list[str]) -> None:
    """Only the missing ones; ``apt-get update`` only when something is missing."""
    wanted = system_packages() + extra
    res = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package} ${Status}\\n", *wanted], capture_output=True, text=True, check=False
    )
    have = {ln.split()[0] for ln in res.stdout.splitlines() if ln.endswith(" install ok installed")}
    missing = [p for p in wanted if p not in have]
    if not missing:
        return
    log(f"installing {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )


def install_criu() -> Path:
    """Build (or find up to date) CRIU with criu/patches into ``PREFIX/criu`` and record it in host.toml."""
    log("CRIU")
    tree = criu_tree()
    dist = PREFIX / "criu"
    env = {**os.environ, "CRIU_DIST": str(dist)}
    if not os.access(tree, os.W_OK) or tree.name == "_criu_build":  # an installed package: build outside it
        env["CRIU_WORK"] = str(BUILD_CACHE)
    subprocess.run(["bash", str(tree / "build.sh")], check=True, env=env)
    version = (tree / "VERSION").read_text().strip()
    changed = write_host_config(
        criu={
            "path": str(dist / "sbin" / "criu"),
            "pycriu": str(dist / "python"),
            "version": version,
            "patches": (dist / "patchset").read_text().strip(),
        }
    )
    if changed:
        print(f"recorded {dist} in {host_config_path()}")
    return dist


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="_hostsetup.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--also", nargs="*", default=[], help="more Debian packages to install (the checkout's)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bunshin setup: must run as root (packages, CRIU, mounts)", file=sys.stderr)
        return 1
    if not Path("/usr/bin/dpkg-query").exists():
        print("bunshin setup: needs Debian 12 or 13 (dpkg and apt)", file=sys.stderr)
        return 1
    install_packages(args.also)
    try:
        install_criu()
    except subprocess.CalledProcessError as exc:
        print(f"bunshin setup: the CRIU build failed (exit {exc.returncode}; its error is above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
