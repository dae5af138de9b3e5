#!/usr/bin/env bash
# The clean-root set-up check: does the README's set-up work on a machine that has never seen Bunshin?
#
# Builds a minimal Debian root (debootstrap --variant=minbase, plus python3 and make, which the README asks the
# user to have). First the way of a user who never cloned the repository: the wheel (built here from this tree)
# installed into a virtual environment of their own, then `bunshin setup` from it, which must set the host up alone
# (packages, CRIU from the packaged patches, host.toml, snapshot store) and leave `bunshin doctor` of that
# environment content. Then it copies this tree into the root (tracked and untracked-but-not-ignored files, as a
# fresh clone has them), and runs `make setup` inside it, which must find CRIU as `bunshin setup` left it (pivoted into it in a private mount namespace, with /proc, /sys and /dev from the
# host and the host's network, so apt and pip reach the package registries). Then `bunshin doctor` must find every system package and capability the
# set-up provides. Any missing install step fails the check with that step's own error.
#
# Only the minimal root is cached between runs (a tarball under $CACHE), never what the set-up installs: every run
# starts from debootstrap's output. Inside a chroot the set-up skips what cannot run there and says so: building the
# Debian workspace images (debootstrap inside the chroot) and starting the Docker daemon (it would be a second
# daemon on the host's kernel). Packages, the CRIU build, the virtual environment, the native extension, the
# snapshot store and `bunshin doctor` all run.
#
#   scripts/check-fresh-setup.sh [bookworm|trixie]     (default bookworm; trixie is Debian 13, Python 3.13)
#   KEEP=1 keeps the root afterwards for inspection; DEBIAN_MIRROR overrides the archive URI.
#   FRESH_TESTS="tests/workspace ..." then runs those tests in the fresh root, on its own Python and its own build
#   of everything, with the host's already-built workspace images bound read-only (the set-up skips building them
#   there); this is how the suite runs on a second Python version (Debian 13's 3.13).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SRC=$PWD
SUITE=${1:-${SUITE:-bookworm}}
CACHE=${BUNSHIN_FRESH_CACHE:-/var/cache/bunshin/fresh}
log() { echo "==> [fresh-check $SUITE] $*"; }
die() { echo "check-fresh-setup: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (debootstrap, chroot, mounts)"
case $SUITE in bookworm | trixie) ;; *) die "suite must be bookworm or trixie, not $SUITE" ;; esac
command -v debootstrap >/dev/null || {
    log "installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
}

# The Debian archive the host's apt uses (deb822 .sources or one-line .list), never a hard-coded host.
mirror() {
    [[ -n "${DEBIAN_MIRROR:-}" ]] && { echo "$DEBIAN_MIRROR"; return; }
    local uris  # captured first: no `cmd | grep -m1` under pipefail (SIGPIPE)
    uris=$({
        cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk 'tolower($1) == "uris:" { print $2 }'
        cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) { print $i; break } }'
    } || true)
    awk '!/security/ && /\/debian\/?$/ { print; exit }' <<<"$uris" | grep . \
        || die "no Debian archive in the host's apt sources (set DEBIAN_MIRROR)"
}

# The wheel a user installs (abi3: one for every Python from 3.10, so also for Debian 13's 3.13), from the sdist.
[[ -x "$SRC/.venv/bin/python" ]] || die "no .venv: run make setup first (it builds the wheel with python -m build)"

MIRROR=$(mirror)
TARBALL="$CACHE/$SUITE-minbase.tar"
mkdir -p "$CACHE"
if [[ ! -s "$TARBALL" ]]; then
    log "building the minimal root once (debootstrap --variant=minbase $SUITE from $MIRROR)"
    tmp=$(mktemp -d "$CACHE/.root-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    debootstrap --variant=minbase --include=python3,make "$SUITE" "$tmp" "$MIRROR" >"$tmp.log" 2>&1 \
        || { tail -20 "$tmp.log" >&2; rm -f "$tmp.log"; die "debootstrap failed"; }
    rm -f "$tmp.log"
    tar -C "$tmp" -cf "$TARBALL.tmp" . && mv "$TARBALL.tmp" "$TARBALL"
    rm -rf "$tmp"
    trap - EXIT
fi

ROOTFS=$(mktemp -d /var/tmp/bunshin-fresh-XXXXXX)
cleanup() {
    local rc=$?
    if [[ "${KEEP:-0}" == 1 ]]; then echo "kept $ROOTFS" >&2; else rm -rf --one-file-system "$ROOTFS"; fi
    exit "$rc"
}
trap cleanup EXIT
log "fresh root $ROOTFS"
tar -C "$ROOTFS" -xf "$TARBALL"
chmod 0755 "$ROOTFS"  # it is the root: unprivileged users (apt's _apt sandbox) must traverse it

log "building the wheel (python -m build)"
"$SRC/.venv/bin/python" -m build --no-isolation --outdir "$ROOTFS/wheel" "$SRC" >"$ROOTFS/wheel.log" 2>&1 \
    || { tail -30 "$ROOTFS/wheel.log" >&2; die "python -m build failed"; }

# The tree as a clone has it: tracked files and untracked files git does not ignore (no .venv, no builds).
mkdir -p "$ROOTFS/src"
git -C "$SRC" ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -e "$f" || -L "$f" ]] && printf '%s\0' "$f"; done \
    | tar -C "$SRC" --null -T - -cf - | tar -C "$ROOTFS/src" -xf -

# The host's network, as the set-up will meet it on this machine: its resolver and the local certificate
# authorities it trusts for TLS (an egress proxy's CA on some networks); ca-certificates, when the set-up installs
# it, adds them to the bundle pip uses.
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
if [[ -d /usr/local/share/ca-certificates ]]; then
    mkdir -p "$ROOTFS/usr/local/share/ca-certificates"
    cp -a /usr/local/share/ca-certificates/. "$ROOTFS/usr/local/share/ca-certificates/"
fi
# As in any chroot: package scripts must not start services (redis, dockerd) that would outlive the check.
printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d" && chmod +x "$ROOTFS/usr/sbin/policy-rc.d"

# The steps, run as the new root's own programs. A private mount namespace pivoted into the fresh root (rather than
# a plain chroot) gives the set-up a clean mount tree, which `criu check` insists on; every mount made there (ours,
# and the snapshot store the set-up mounts) disappears with the namespace.
cat >"$ROOTFS/fresh-check.sh" <<'INNER'
set -uo pipefail
cd /src
step() { echo "==> [in the fresh root] $*"; }
step "$(. /etc/os-release; echo "$PRETTY_NAME, $(python3 --version)")"
start=$(date +%s)
step "a user's own environment: python3-venv, a virtual environment outside any checkout, the wheel"
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv \
    && python3 -m venv /opt/user-env && /opt/user-env/bin/python -m pip install -q /wheel/*.whl; } >/user-env.log 2>&1 \
    || { tail -30 /user-env.log; exit 14; }
step "bunshin setup (from the installed wheel, not the Makefile)"
(cd / && /opt/user-env/bin/bunshin setup) >/bunshin-setup.log 2>&1
rc=$?
grep -E '^(==>|skipped|criu .* up to date|recorded|E:|bunshin setup|build.sh)' /bunshin-setup.log
if ((rc)); then
    echo "---- last lines of bunshin setup ----"
    tail -30 /bunshin-setup.log
    exit 14
fi
step "bunshin setup took $(($(date +%s) - start)) s"
(cd / && /opt/user-env/bin/bunshin doctor) >/doctor-user.log 2>&1
grep -E '^(ok|MISS) +(criu|host set-up|fork mode|snapshot store) ' /doctor-user.log
start=$(date +%s)
step "make setup (the README's set-up)"
make setup >/setup.log 2>&1
rc=$?
grep -E '^(==>|skipped|criu .* up to date|E:|build.sh|setup.sh|docker.sh)' /setup.log
if ((rc)); then
    echo "---- last lines of the set-up ----"
    grep -v '^WARNING: Location' /setup.log | tail -30
    exit 10
fi
step "set-up took $(($(date +%s) - start)) s"
if grep -E '^==> building criu' /setup.log; then exit 15; fi
start=$(date +%s)
make setup >/setup2.log 2>&1 || { tail -30 /setup2.log; exit 11; }
step "second run took $(($(date +%s) - start)) s"
if grep -E '^==> installing|building criu|creating .venv' /setup2.log; then exit 12; fi
step "bunshin doctor"
.venv/bin/bunshin doctor >/doctor.log 2>&1
cat /doctor.log
if [[ -n "${FRESH_TESTS:-}" ]]; then
    step "pytest $FRESH_TESTS on $(.venv/bin/python --version)"
    # shellcheck disable=SC2086
    .venv/bin/python -m pytest -q -p no:cacheprovider $FRESH_TESTS || exit 13
fi
exit 0
INNER

unshare --mount --propagation private bash -euo pipefail -c '
    R=$1
    mount --bind "$R" "$R"
    mount -t proc proc "$R/proc"
    mount --rbind /sys "$R/sys"
    mount --bind /dev "$R/dev"
    mount --bind /dev/pts "$R/dev/pts"
    mount -t tmpfs -o mode=1777 tmpfs "$R/dev/shm"
    mount -t tmpfs -o mode=0755 tmpfs "$R/run"
    if [[ -n "${FRESH_TESTS:-}" ]]; then
        mkdir -p "$R/var/lib/bunshin/images"
        mount --bind -o ro /var/lib/bunshin/images "$R/var/lib/bunshin/images"
        mount -o remount,bind,ro "$R/var/lib/bunshin/images"
    fi
    mkdir -p "$R/.oldroot"
    cd "$R"
    pivot_root . .oldroot
    umount --lazy /.oldroot
    exec /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LANG=C.UTF-8 TERM=dumb BUNSHIN_CLEAN_ROOT_CHECK=1 FRESH_TESTS="${FRESH_TESTS:-}" /bin/bash /fresh-check.sh
' fresh-check "$ROOTFS" | sed -u "s/^/    /" && rc=0 || rc=$?
case $rc in
    0) ;;
    10) die "the set-up failed in a fresh $SUITE root (above: the failing step's own error)" ;;
    11) die "the second set-up run failed" ;;
    12) die "the second set-up run installed or built something again (not idempotent)" ;;
    13) die "tests failed in the fresh $SUITE root (FRESH_TESTS=$FRESH_TESTS)" ;;
    14) die "a user's environment with the wheel, or \`bunshin setup\` from it, failed in a fresh $SUITE root (above)" ;;
    15) die "make setup built CRIU again after \`bunshin setup\` had (the two set-ups must share one install)" ;;
    *) die "the check itself failed (exit $rc)" ;;
esac
# In a chroot the workspace images are not built and dockerd is not started (said above); everything else the
# set-up provides must be there. (A per-workspace user namespace is a protection Bunshin does not have yet, not
# something the set-up installs: doctor reports it on every host.)
# `bunshin doctor` of the user's environment (after `bunshin setup` alone) and of the checkout's (after make setup).
for report in doctor-user.log doctor.log; do
    missing=$(grep '^MISS' "$ROOTFS/$report" | grep -v -E '^MISS +(base image|docker engine|user namespace per workspace) ' || true)
    [[ -z "$missing" ]] || die "bunshin doctor ($report) reports missing pieces after the set-up: $missing"
done
log "passed"
