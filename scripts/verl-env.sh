#!/usr/bin/env bash
# verl's own virtual environment, .venv-verl: verl pulls torch, which the main venv stays without. Idempotent: it is
# built once per requirements-verl.lock under the Bunshin home (${BUNSHIN_HOME:-/var/lib/bunshin}/venv-verl-<lock>),
# shared by every checkout (a fresh clone, CI's included, links .venv-verl to it instead of downloading ~1.9 GB
# again), and takes a second otherwise. torch is the CPU build from the
# local wheel directory (no GPU is needed to run verl's agent loop); Bunshin itself comes from this tree (a .pth).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
WHEELS=${BUNSHIN_WHEELS:-/opt/wheels}

if [[ -n "${BUNSHIN_CLEAN_ROOT_CHECK:-}" ]]; then
    # The clean-root check's root has no wheel directory for torch's CPU build, and building this environment
    # there would download ~1.9 GB on every `make test`.
    echo "skipped (clean-root check): verl's environment (.venv-verl; torch's CPU build comes from $WHEELS)"
    exit 0
fi
lock_sum=$(sha256sum requirements-verl.lock | cut -d' ' -f1)
VENV=${BUNSHIN_HOME:-/var/lib/bunshin}/venv-verl-${lock_sum:0:16}
link_tree() {
    # Bunshin itself comes from the checkout that ran this last (its .pth files), and .venv-verl points at the env.
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$ROOT" > "$site/bunshin-src.pth"
    echo "$ROOT/criu/dist/python" > "$site/bunshin-pycriu.pth"
    [[ -L .venv-verl && "$(readlink .venv-verl)" == "$VENV" ]] && return
    rm -rf .venv-verl
    ln -s "$VENV" .venv-verl
}
if [[ -x "$VENV/bin/python" && "$(cat "$VENV/.lock-sum" 2>/dev/null)" == "$lock_sum" ]]; then
    link_tree
    exit 0
fi
echo "==> verl environment ($VENV)"
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
find_links=()
[[ -d "$WHEELS" ]] && find_links=(--find-links "$WHEELS")
# --no-deps: every package is pinned in the lock (see its header for why the resolver must not run).
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "${find_links[@]}" -r requirements-verl.lock
link_tree
.venv-verl/bin/python -c 'import verl, torch, bunshin_async._native' >/dev/null
echo "$lock_sum" > "$VENV/.lock-sum"
