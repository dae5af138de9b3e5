#!/usr/bin/env bash
# Everything Bunshin needs on a fresh Debian 12 machine, idempotently (seconds when already done): the host set-up
# that `bunshin setup` does from an installed package (system packages, CRIU 4.2.1 from criu/patches, the snapshot
# store, the images), plus what the checkout needs: the kmod guest kernel, Docker, the virtual environment with
# pinned dependencies and the package itself (editable: native extension, init and agent), verl's environment.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
log() { echo "==> $*"; }

[[ $(id -u) -eq 0 ]] || { echo "setup.sh: must run as root (namespaces, mounts, cgroups, CRIU)" >&2; exit 1; }
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; assert sys.version_info[:2] >= (3, 10), sys.version' 2>/dev/null || {
    echo "setup.sh: need Python 3.10 or later on the host (set PYTHON=)" >&2
    exit 1
}

# The host part, the same code `bunshin setup` runs from an installed package (bunshin_async/_host/_hostsetup.py, stdlib
# only, run isolated so nothing of the checkout shadows the standard library): the missing system packages of
# bunshin_async/system-packages.txt (which `bunshin doctor` reads too), CRIU 4.2.1 from criu/patches into
# /usr/local/lib/bunshin/criu, and /etc/bunshin/host.toml, where every Bunshin on this host finds that CRIU.
# Debian's python3 needs its venv module and headers as separate packages (a python built elsewhere has both).
extra=()
"$PYTHON" -c 'import ensurepip' 2>/dev/null || extra+=("python3-venv")
[[ -f "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]] || extra+=("python3-dev")
"$PYTHON" -I bunshin_async/_host/_hostsetup.py --also ${extra[@]+"${extra[@]}"}
# Debian starts redis-server on install; tests start their own on other ports.

# The checkout's criu/dist is the host's install (worktrees link to it), replaced by a link in two renames.
CRIU_DIST=${BUNSHIN_PREFIX:-/usr/local/lib/bunshin}/criu
if [[ "$(readlink criu/dist 2>/dev/null || true)" != "$CRIU_DIST" ]]; then
    rm -rf criu/dist.new criu/dist.old
    ln -s "$CRIU_DIST" criu/dist.new
    if [[ -e criu/dist || -L criu/dist ]]; then mv -T criu/dist criu/dist.old; fi
    mv -T criu/dist.new criu/dist
    rm -rf criu/dist.old
fi

# The kernel-module guest (kmod/): the pinned Debian kernel's headers and image. In the clean-root check a second
# kernel in the chroot is a minute and a half for nothing that check looks at; qemu and cpio are packages above.
if [[ -n "${BUNSHIN_CLEAN_ROOT_CHECK:-}" ]]; then
    echo "skipped (clean-root check): the kmod guest kernel (linux-headers + linux-image, kmod/setup.sh)"
else
    log "kmod guest kernel"
    kmod/setup.sh
fi

log "Docker engine"
if [[ -n "${BUNSHIN_CLEAN_ROOT_CHECK:-}" ]]; then
    BUNSHIN_DOCKER_NO_START=1 scripts/docker.sh
else
    scripts/docker.sh
fi

# The virtual environment, re-synced only when requirements.lock changes.
if [[ ! -x .venv/bin/python ]]; then
    log "creating .venv"
    "$PYTHON" -m venv .venv
fi
lock_sum=$(sha256sum requirements.lock | cut -d' ' -f1)
if [[ "$(cat .venv/.lock-sum 2>/dev/null)" != "$lock_sum" ]]; then
    log "installing pinned dependencies"
    .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.lock
    echo "$lock_sum" > .venv/.lock-sum
fi
# pycriu comes from the CRIU tree it was built with.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT/criu/dist/python" > "$site/bunshin-pycriu.pth"

# The package itself (editable) with its extension and init binary, rebuilt when native code changes.
native_sum=$(cat native/*.[ch] setup.py pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ "$(cat .venv/.native-sum 2>/dev/null)" != "$native_sum" || ! -x bunshin_async/bunshin-init \
    || ! -x bunshin_async/bunshin-agent ]] \
    || ! .venv/bin/python -c 'import bunshin_async._native' 2>/dev/null; then
    log "building bunshin (native extension, workspace init)"
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
    echo "$native_sum" > .venv/.native-sum
fi

# verl's own environment (verl pulls torch; the main venv stays light): rebuilt only when its lock changes.
scripts/verl-env.sh
# The agent harnesses' environments (inspect-ai, mini-swe-agent; Harbor where Python >= 3.12): rebuilt per lock.
scripts/harness-env.sh

# What needs the package: the snapshot store, the package's record in host.toml and the workspace images (the base
# image and the GUI image; skipped in the clean-root check), as `bunshin setup` does for an installed package.
.venv/bin/bunshin setup --gui
log "ready"
