#!/usr/bin/env bash
# Fetch (from Debian sid via apt), verify, patch, build and install CRIU into
# $CRIU_DIST (default criu/dist; the host set-up, bunshin_async/_host/_hostsetup.py,
# installs it to /usr/local/lib/bunshin/criu). Idempotent; see README.md. The
# wheel ships this directory (VERSION, SHA256, patches, this script) as package
# data, so `bunshin setup` builds the same CRIU from an installed package.
#
# Environment overrides:
#   CRIU_DIST      where to install (sbin/criu, python/pycriu, patchset)
#   CRIU_WORK      where the source tarball cache and build tree go (default: here)
#   CRIU_RUNDIR    kdat cache dir baked into the binary (default: /run/criu-<build>
#                  if /run is a tmpfs, else /dev/shm/criu-<build>)
#   DEBIAN_MIRROR  Debian archive URI (default: parsed from the apt sources)
#   CRIU_FORCE=1   rebuild even if up to date
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$HERE"

VERSION=$(tr -d '[:space:]' < VERSION)
SHA256=$(awk 'NF { print $1; exit }' SHA256)
DIST=${CRIU_DIST:-$HERE/dist}
WORK=${CRIU_WORK:-$HERE}
CACHE="$WORK/.cache"
BUILD="$WORK/.build"
STAMP="$DIST/.stamp"
TARBALL="$CACHE/criu_${VERSION}.orig.tar.xz"

APT_TMP=
trap '[[ -z "$APT_TMP" ]] || rm -rf "$APT_TMP"' EXIT
die() { echo "build.sh: error: $*" >&2; exit 1; }
log() { echo "==> $*"; }

# --- patch series -----------------------------------------------------------
PATCHES=()
while IFS= read -r line || [[ -n "$line" ]]; do
    line=${line%%#*}
    line=${line#"${line%%[![:space:]]*}"}; line=${line%"${line##*[![:space:]]}"}  # trim
    [[ -z "$line" ]] && continue
    [[ -f "patches/$line" ]] || die "patch listed in patches/series not found: patches/$line"
    PATCHES+=("patches/$line")
done < patches/series

# The patch set this build carries (what `bunshin doctor` and the package compare with the host's install;
# bunshin_async/_host/_hostsetup.py computes the same digest): VERSION, SHA256, series and each listed patch.
PATCHSET=$( { cat VERSION SHA256 patches/series; for p in ${PATCHES[@]+"${PATCHES[@]}"}; do cat "$p"; done; } \
            | sha256sum | cut -c1-16)

# --- kdat cache dir (RUNDIR) ------------------------------------------------
# CRIU 4.2.1 bakes $(RUNDIR) into criu/kerndat.c as KDAT_RUNDIR and stores
# "$RUNDIR/criu.kdat" there, but only if that dir is on a tmpfs (it checks
# TMPFS_MAGIC) and already exists (it never creates it). The cache's magic is
# the build time, so two builds sharing a dir (worktrees with other patches)
# would make each other re-probe at every run: the dir is named per build.
BUILD_ID=$( { cat VERSION SHA256 patches/series ${PATCHES[@]+"${PATCHES[@]}"} "$HERE/build.sh"; } \
            | sha256sum | cut -c1-12)
if [[ -n "${CRIU_RUNDIR:-}" ]]; then
    RUNDIR=$CRIU_RUNDIR
elif [[ "$(stat -f -c %T /run 2>/dev/null || true)" == tmpfs ]]; then
    RUNDIR=/run/criu-$BUILD_ID
else
    RUNDIR=/dev/shm/criu-$BUILD_ID
fi
ensure_rundir() { mkdir -p -m 0700 "$RUNDIR" 2>/dev/null || true; }

# --- stamp: sha256(VERSION + SHA256 + series + patches + build.sh + RUNDIR) --
want_stamp=$( { cat VERSION SHA256 patches/series ${PATCHES[@]+"${PATCHES[@]}"} "$HERE/build.sh"; echo "RUNDIR=$RUNDIR"; } \
              | sha256sum | cut -d' ' -f1)

up_to_date() {
    [[ -x "$DIST/sbin/criu" && -f "$STAMP" && -f "$DIST/python/pycriu/rpc_pb2.py" ]] || return 1
    [[ "$(cat "$DIST/patchset" 2>/dev/null)" == "$PATCHSET" ]] || return 1
    [[ "$(cat "$STAMP")" == "$want_stamp" ]] || return 1
    # Capture first: grep -q exits at the first match and, under pipefail, the
    # SIGPIPE criu gets writing its next line ("Features: ...") fails the pipe.
    grep -qx "Version: $VERSION" <<<"$("$DIST/sbin/criu" --version 2>/dev/null || true)"
}

if [[ "${CRIU_FORCE:-0}" != 1 ]] && up_to_date; then
    ensure_rundir
    echo "criu $VERSION up to date"
    exit 0
fi

[[ $(id -u) == 0 ]] || die "must run as root (installs packages; 'criu check' needs root)"

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if [[ "${CRIU_FORCE:-0}" != 1 ]] && up_to_date; then  # another run just did it
    ensure_rundir
    echo "criu $VERSION up to date"
    exit 0
fi

# --- 1. build dependencies ------------------------------------------------
DEPS=(gcc make libc6-dev pkg-config patch xz-utils python3
      libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler protobuf-compiler python3-protobuf
      libnl-3-dev libnet1-dev libcap-dev libbsd-dev libaio-dev libgnutls28-dev
      libnftables-dev uuid-dev libdrm-dev)
missing=()
for p in "${DEPS[@]}"; do
    [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" == "install ok installed" ]] \
        || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing build deps: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends "${missing[@]}"; then
        apt-get update
        apt-get install -y --no-install-recommends "${missing[@]}"
    fi
fi

# --- 2. source tarball (Debian sid orig tarball, sha256-pinned) --------------
sha_ok() { [[ -f "$1" && "$(sha256sum "$1" | cut -d' ' -f1)" == "$SHA256" ]]; }

# Print "URI<TAB>signed-by-keyring" of the main Debian archive configured in apt.
find_debian_mirror() {
    local codename
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    {
        # one-line format: deb [opts] URI suite comp...
        { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } | awk '
            { sub(/#.*/, "") }
            $1 == "deb" || $1 == "deb-src" {
                opts = ""; i = 2
                if ($2 ~ /^\[/) { while (i <= NF) { opts = opts " " $i; if ($i ~ /\]$/) { i++; break } i++ } }
                sb = ""; if (match(opts, /signed-by=[^] ]+/)) sb = substr(opts, RSTART + 10, RLENGTH - 10)
                print $(i) "\t" $(i + 1) "\t" sb
            }'
        # deb822 format
        for f in /etc/apt/sources.list.d/*.sources; do
            [[ -f "$f" ]] || continue
            awk 'BEGIN { RS = ""; FS = "\n" }
            {
                types = uris = suites = sb = ""; enabled = "yes"
                for (i = 1; i <= NF; i++) {
                    l = $i
                    if (l ~ /^#/ || l ~ /^[ \t]/) continue
                    k = tolower(l); sub(/:.*/, "", k); v = l; sub(/^[^:]*:[ \t]*/, "", v)
                    if (k == "types") types = v; else if (k == "uris") uris = v
                    else if (k == "suites") suites = v; else if (k == "enabled") enabled = tolower(v)
                    else if (k == "signed-by" && v ~ /^\//) sb = v
                }
                if (enabled == "no" || types !~ /(^| )deb($| )/) next
                n = split(uris, U, /[ \t]+/); m = split(suites, S, /[ \t]+/)
                for (a = 1; a <= n; a++) for (b = 1; b <= m; b++) print U[a] "\t" S[b] "\t" sb
            }' "$f"
        done
    } | awk -F'\t' -v cn="$codename" '
        $1 ~ /security/ || $2 ~ /-security$/ || $1 == "" { next }
        $2 == cn || $2 ~ /^(stable|oldstable|testing|unstable|sid)$/ { print $1 "\t" $3; found = 1; exit }
        $1 ~ /\/debian\/?$/ && fb == "" { fb = $1 "\t" $3 }
        END { if (!found && fb != "") print fb }'
}

fetch_tarball() {
    local mirror keyring tmp debver opt=()
    if [[ -n "${DEBIAN_MIRROR:-}" ]]; then
        mirror=$DEBIAN_MIRROR keyring=
    else
        IFS=$'\t' read -r mirror keyring < <(find_debian_mirror) || true
    fi
    [[ -n "${mirror:-}" ]] || die "could not find the Debian archive URI in /etc/apt/sources.list{,.d/} (set DEBIAN_MIRROR)"
    mirror=${mirror%/}
    [[ -n "$keyring" && -r "$keyring" ]] && opt=("signed-by=$keyring")
    log "fetching criu $VERSION source from $mirror sid (temporary apt config)"

    tmp=$(mktemp -d /tmp/criu-apt.XXXXXX)
    APT_TMP=$tmp
    chmod 0755 "$tmp"
    mkdir -p "$tmp/parts" "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/dl"
    echo "deb-src ${opt:+[${opt[*]}] }$mirror sid main" > "$tmp/sources.list"
    # Extra config read after the system's: private lists/cache, no update hooks.
    cat > "$tmp/apt.conf" <<EOF
Dir::Etc::SourceList "$tmp/sources.list";
Dir::Etc::SourceParts "$tmp/parts";
Dir::State::Lists "$tmp/lists";
Dir::Cache "$tmp/cache";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
#clear APT::Update::Post-Invoke;
#clear APT::Update::Post-Invoke-Success;
#clear APT::Update::Pre-Invoke;
EOF
    # Keep apt's _apt download sandbox working on our private dirs.
    if id _apt >/dev/null 2>&1; then chown -R _apt "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/dl"; fi
    local APT=(-c "$tmp/apt.conf"
               -o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=$tmp/parts"
               -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache"
               # sid's Release carries a Valid-Until that a frozen or slow mirror outlives; the tarball's
               # sha256 (criu/SHA256) is what we trust, not the index's freshness.
               -o "Acquire::Check-Valid-Until=false")

    apt-get "${APT[@]}" -q update >"$tmp/update.log" 2>&1 \
        || { cat "$tmp/update.log" >&2; die "apt-get update of $mirror sid (deb-src) failed"; }
    debver=$(apt-cache "${APT[@]}" showsrc criu 2>/dev/null \
             | awk -v v="$VERSION" '$1 == "Version:" { x = $2; sub(/^[0-9]+:/, "", x); if (index(x, v "-") == 1) print $2 }' \
             | sort -V | tail -1)
    [[ -n "$debver" ]] || die "criu $VERSION is no longer in Debian sid (available: $(apt-cache "${APT[@]}" showsrc criu 2>/dev/null | awk '$1 == "Version:" { printf "%s ", $2 }')); update criu/VERSION and criu/SHA256"
    log "Debian source package criu=$debver"
    # Only the orig tarball is needed; the .debian.tar may be unavailable through
    # some mirrors/proxies, so apt-get's exit status is not fatal by itself.
    (cd "$tmp/dl" && apt-get "${APT[@]}" -q source --download-only "criu=$debver") >"$tmp/source.log" 2>&1 || true
    local orig="$tmp/dl/criu_${VERSION}.orig.tar.xz"
    [[ -f "$orig" ]] || { cat "$tmp/source.log" >&2; die "download of criu_${VERSION}.orig.tar.xz failed"; }
    local got; got=$(sha256sum "$orig" | cut -d' ' -f1)
    [[ "$got" == "$SHA256" ]] || die "checksum mismatch for criu_${VERSION}.orig.tar.xz: got $got, expected $SHA256 (criu/SHA256)"
    install -m 0644 "$orig" "$TARBALL.tmp" && mv -f "$TARBALL.tmp" "$TARBALL"
    log "verified and cached $TARBALL"
}

if sha_ok "$TARBALL"; then
    log "using cached $TARBALL (sha256 ok)"
else
    rm -f "$TARBALL"
    fetch_tarball
fi

# --- 3. build ---------------------------------------------------------------
t0=$SECONDS
rm -rf "$BUILD"
mkdir -p "$BUILD/src"
tar -xJf "$TARBALL" -C "$BUILD/src" --strip-components=1
for p in ${PATCHES[@]+"${PATCHES[@]}"}; do
    log "applying $p"
    patch -d "$BUILD/src" -p1 --forward --batch < "$p" || die "patch $p does not apply to criu $VERSION"
done

# Use the system python3 (stdlib only, for scripts/magic-gen.py) rather than
# whatever python3 comes first in PATH (venvs, pyenv shims).
PY=/usr/bin/python3
# Without GnuTLS (NO_GNUTLS=1: --tls page servers, which Bunshin never uses; criu refuses --tls then) and without
# libnftables (a pkg-config that does not see it: only --network-lock nftables uses it; dumps here skip the lock and
# restores use the iptables default): criu loads 7 shared libraries instead of 21, and every criu process, two a
# fork, starts ~2 ms sooner (dynamic linking and GnuTLS's constructor, which parses its ASN.1 tables).
printf '#!/bin/sh\nfor arg; do [ "$arg" = libnftables ] && exit 1; done\nexec pkg-config "$@"\n' >"$BUILD/pkg-config"
chmod 0755 "$BUILD/pkg-config"
log "building criu $VERSION (RUNDIR=$RUNDIR, make -j$(nproc))"
make -C "$BUILD/src" -j"$(nproc)" PYTHON="$PY" RUNDIR="$RUNDIR" NO_GNUTLS=1 PKG_CONFIG="$BUILD/pkg-config" \
    criu lib >"$BUILD/make.log" 2>&1 \
    || { tail -50 "$BUILD/make.log" >&2
         # With -j2 the first error is often far above the tail: name it.
         grep -m3 -E 'No rule to make target|\*\*\*|error:' "$BUILD/make.log" >&2 || true
         die "make failed (full log: $BUILD/make.log)"; }
grep -E '^(Note|Warn):' "$BUILD/make.log" | sort -u || true

# --- 4. install into criu/dist ----------------------------------------------
stage="$BUILD/dist"
mkdir -p "$stage/sbin" "$stage/python"
install -m 0755 "$BUILD/src/criu/criu" "$stage/sbin/criu"
(cd "$BUILD/src/lib" && find pycriu -name '*.py' -exec install -D -m 0644 {} "$stage/python/{}" \;)
echo "$PATCHSET" > "$stage/patchset"

mkdir -p "$(dirname "$DIST")"
rm -rf "$DIST.old"
[[ -e "$DIST" || -L "$DIST" ]] && mv "$DIST" "$DIST.old"
mv "$stage" "$DIST"
rm -rf "$DIST.old"
ensure_rundir
log "installed $DIST/sbin/criu and $DIST/python/pycriu ($((SECONDS - t0))s)"

# --- 5. sanity checks -------------------------------------------------------
grep -qx "Version: $VERSION" <<<"$("$DIST/sbin/criu" --version)" || die "dist/sbin/criu --version is not $VERSION"
VENV_PY="$HERE/../.venv/bin/python"
for py in "$PY" "$VENV_PY"; do
    [[ -x "$py" ]] || continue
    "$py" -c 'import sys; sys.path.insert(0, sys.argv[1]); import pycriu, pycriu.rpc_pb2, pycriu.images' "$DIST/python" \
        || die "pycriu import failed with $py"
done
out=$("$DIST/sbin/criu" check 2>&1) || true
echo "$out"
grep -q "Looks good" <<<"$out" || die "'criu check' did not report 'Looks good'"

echo "$want_stamp" > "$STAMP"
echo "criu $VERSION built and installed in $DIST"
