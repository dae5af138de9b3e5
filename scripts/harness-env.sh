#!/usr/bin/env bash
# The agent harnesses' own virtual environments (the main venv's pins do not admit them; see each lock's header):
#   .venv-harness  inspect-ai and mini-swe-agent (requirements-harness.lock), on the set-up's Python;
#   .venv-verifiers verifiers[e2b] (requirements-verifiers.lock), the second client of the E2B server's tests;
#   .venv-harbor   Harbor (requirements-harbor.lock), only when the set-up's Python is 3.12 or later (Harbor's
#                  floor): Debian 13's 3.13, which the clean-root check's trixie root runs its FRESH_TESTS on.
# Idempotent, as scripts/verl-env.sh: each is built once per lock under the Bunshin home and linked into the tree;
# Bunshin itself comes from this tree (a .pth). The clean-root check builds only what its FRESH_TESTS use (Harbor).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
HOME_DIR=${BUNSHIN_HOME:-/var/lib/bunshin}

# build_env NAME LOCK LINK: the environment for LOCK under the Bunshin home, linked as LINK.
build_env() {
    local name=$1 lock=$2 link=$3 lock_sum venv site
    lock_sum=$(sha256sum "$lock" | cut -d' ' -f1)
    venv=$HOME_DIR/venv-$name-${lock_sum:0:16}
    if [[ ! -x "$venv/bin/python" || "$(cat "$venv/.lock-sum" 2>/dev/null)" != "$lock_sum" ]]; then
        echo "==> $name environment ($venv)"
        rm -rf "$venv"
        mkdir -p "$HOME_DIR"
        "$PYTHON" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$lock"
        echo "$lock_sum" >"$venv/.lock-sum"
    fi
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$ROOT" >"$site/bunshin-src.pth"
    echo "$ROOT/criu/dist/python" >"$site/bunshin-pycriu.pth"
    # The package's entry points (inspect-ai finds the `bunshin` sandbox through them), read from pyproject.toml:
    # the tree is on the path by the .pth, not installed, so its metadata is written here.
    "$venv/bin/python" - "$ROOT/pyproject.toml" "$site/bunshin_tree-0.0.0.dist-info" <<'PY'
import pathlib, sys, tomllib
eps = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"].get("entry-points", {})
out = pathlib.Path(sys.argv[2])
out.mkdir(exist_ok=True)
(out / "METADATA").write_text("Metadata-Version: 2.1\nName: bunshin-tree\nVersion: 0.0.0\n")
(out / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) for g, e in eps.items()))
PY
    if [[ ! -L "$link" || "$(readlink "$link")" != "$venv" ]]; then
        rm -rf "$link"
        ln -s "$venv" "$link"
    fi
}

if [[ -n "${BUNSHIN_CLEAN_ROOT_CHECK:-}" ]]; then
    echo "skipped (clean-root check): .venv-harness (inspect-ai, mini-swe-agent) and .venv-verifiers (verifiers)"
else
    build_env harness requirements-harness.lock .venv-harness
    MSWEA_SILENT_STARTUP=1 .venv-harness/bin/python -c 'import inspect_ai, minisweagent, bunshin_async' >/dev/null
    build_env verifiers requirements-verifiers.lock .venv-verifiers
    .venv-verifiers/bin/python -c 'import verifiers.v1.runtimes.e2b, e2b' >/dev/null
fi

if "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    build_env harbor requirements-harbor.lock .venv-harbor
    .venv-harbor/bin/python -c 'import harbor, bunshin_async' >/dev/null
else
    echo "skipped: Harbor's environment (.venv-harbor) needs Python >= 3.12, $("$PYTHON" --version) here"
fi
