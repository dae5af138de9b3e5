#!/usr/bin/env bash
# Everything Bunshin needs on a fresh Debian 12 machine, idempotently (seconds when already done):
# system packages, CRIU 4.2.1 (criu/build.sh), the virtual environment with pinned dependencies, the native
# extension and workspace init, and the cached base image.
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

# System packages: only the missing ones, apt-get update only when something is missing.
# The list is bunshin_async/system-packages.txt, which `bunshin doctor` reads too.
mapfile -t PACKAGES < <(awk '!/^#/ && NF { print $1 }' bunshin_async/system-packages.txt)
# Debian's python3 needs its venv module and headers as separate packages (a python built elsewhere has both).
"$PYTHON" -c 'import ensurepip' 2>/dev/null || PACKAGES+=("python3-venv")
[[ -f "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]] || PACKAGES+=("python3-dev")
missing=()
for p in "${PACKAGES[@]}"; do
    [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" == "install ok installed" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian starts redis-server on install; tests start their own on other ports.

log "CRIU"
criu/build.sh

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

log "snapshot store"
.venv/bin/bunshin snapstore

if [[ -n "${BUNSHIN_CLEAN_ROOT_CHECK:-}" ]]; then
    echo "skipped (clean-root check): building the workspace images (debootstrap inside a chroot)"
else
    log "base image"
    .venv/bin/bunshin image build
    .venv/bin/bunshin image build --gui
fi
log "ready"
