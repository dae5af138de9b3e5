#!/usr/bin/env bash
# What the kernel-module tests need beyond bunshin_async/system-packages.txt (qemu-system-x86, cpio,
# busybox-static), idempotently (a second run only checks): the pinned Debian kernel's headers (the module builds
# against them) and its image unpacked under $BUNSHIN_KMOD_CACHE (qemu boots it), with xz-utils and zstd to unpack it.
#
# The image is unpacked, not installed: installing a linux-image package would add a boot entry and build an
# initramfs for a kernel this host never boots. kmod/run-vm.sh only needs the kernel file.
set -euo pipefail
KMOD=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "==> $*"; }
# shellcheck source=kmod/kernel.env
. "$KMOD/kernel.env"
SUITE=${SUITE:-$(. /etc/os-release; echo "${VERSION_CODENAME:-}")}
kver_var=KVER_$SUITE pkgver_var=KPKGVER_$SUITE
if [[ -z "${!kver_var:-}" ]]; then
    echo "skipped: kernel-module guest kernel (no pinned kernel for Debian suite '${SUITE:-unknown}' in kmod/kernel.env)"
    exit 0
fi
KVER=${!kver_var} KPKGVER=${!pkgver_var}
CACHE=${BUNSHIN_KMOD_CACHE:-/var/cache/bunshin/kmod}

installed() { [[ "$(dpkg-query -W -f='${Status} ${Version}' "$1" 2>/dev/null || true)" == "install ok installed ${2:-}"* ]]; }
missing=()
installed "linux-headers-$KVER" "$KPKGVER" || missing+=("linux-headers-$KVER=$KPKGVER")
for p in xz-utils zstd; do installed "$p" || missing+=("$p"); done  # the kernel image's decompressors
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || { echo "kmod/setup.sh: installing ${missing[*]} failed (when a point release has replaced" \
            "linux-headers-$KVER $KPKGVER in the archive, pin the suite's current kernel in kmod/kernel.env)" >&2; exit 1; }
fi

if [[ ! -s "$CACHE/$KVER/vmlinux" || "$(cat "$CACHE/$KVER/version" 2>/dev/null)" != "$KPKGVER" ]]; then
    log "unpacking the guest kernel linux-image-$KVER $KPKGVER into $CACHE/$KVER"
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.image-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    # apt's download sandbox user must be able to write the target directory.
    chmod 0755 "$tmp" && chown _apt "$tmp" 2>/dev/null || true
    (cd "$tmp" && apt-get download -qq "linux-image-$KVER=$KPKGVER" 2>/dev/null) \
        || { apt-get update -qq && (cd "$tmp" && apt-get download -qq "linux-image-$KVER=$KPKGVER"); }
    dpkg-deb --fsys-tarfile "$tmp"/linux-image-*.deb | tar -C "$tmp" -x "./boot/vmlinuz-$KVER"
    mkdir -p "$tmp/out"
    mv "$tmp/boot/vmlinuz-$KVER" "$tmp/out/vmlinuz"
    # The ELF inside the bzImage, found as the kernel's scripts/extract-vmlinux finds it (the first compressed
    # stream: xz on bookworm, zstd on trixie): qemu boots it through its PVH entry, which skips the decompression
    # that costs ~8 s under software emulation. The decompressor exits non-zero on the bzImage's bytes after the
    # stream; the ELF itself is complete (its magic is checked).
    for z in 'xz \xfd7zXZ\x00' 'zstd \x28\xb5\x2f\xfd'; do
        pos=$(LC_ALL=C grep -aboP "${z#* }" "$tmp/out/vmlinuz" | head -n 1 | cut -d: -f1 || true)
        [[ -n $pos ]] || continue
        tail -c +$((pos + 1)) "$tmp/out/vmlinuz" | "${z%% *}" -dcq >"$tmp/out/vmlinux" 2>/dev/null || true
        break
    done
    LC_ALL=C head -c 4 "$tmp/out/vmlinux" 2>/dev/null | grep -q $'\x7fELF' \
        || { echo "kmod/setup.sh: could not unpack the ELF kernel from vmlinuz-$KVER" >&2; exit 1; }
    echo "$KPKGVER" >"$tmp/out/version"
    rm -rf "${CACHE:?}/$KVER"
    mv "$tmp/out" "$CACHE/$KVER"
    rm -rf "$tmp"
    trap - EXIT
fi
# The modules CRIU needs in the guest (kmod/run-vm.sh's criu jobs): its kernel-feature probe runs libnftables,
# which exits when the kernel has no nf_tables; Debian builds nf_tables and what it loads as modules. Those the
# package holds (.ko, or compressed) are unpacked in load order into modules/, listed in modules/order; one it
# lacks is built in.
CRIU_MODS="crypto/crc32c_generic lib/libcrc32c net/netfilter/nfnetlink net/netfilter/nf_tables"
if [[ ! -s "$CACHE/$KVER/modules/order" ]]; then
    log "unpacking the guest's modules for CRIU (nf_tables) from linux-image-$KVER $KPKGVER"
    tmp=$(mktemp -d "$CACHE/.modules-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    chmod 0755 "$tmp" && chown _apt "$tmp" 2>/dev/null || true
    (cd "$tmp" && apt-get download -qq "linux-image-$KVER=$KPKGVER" 2>/dev/null) \
        || { apt-get update -qq && (cd "$tmp" && apt-get download -qq "linux-image-$KVER=$KPKGVER"); }
    dpkg-deb --fsys-tarfile "$tmp"/linux-image-*.deb >"$tmp/image.tar"
    tar -tf "$tmp/image.tar" >"$tmp/list"
    mkdir -p "$tmp/out"
    # trixie's kernel versions hold a '+' (6.12.117+deb13-amd64) and its modules live under ./usr/lib/modules
    kver_re=$(sed 's/[.+]/\\&/g' <<<"$KVER")
    for m in $CRIU_MODS; do
        path=$(grep -E "^\./(usr/)?lib/modules/$kver_re/kernel/$m\.ko(\.xz|\.zst)?$" "$tmp/list" | head -n 1 || true)
        [[ -n $path ]] || continue
        tar -C "$tmp" -xf "$tmp/image.tar" "$path"
        name=$(basename "$m")
        case $path in
            *.xz) xz -dc "$tmp/$path" >"$tmp/out/$name.ko" ;;
            *.zst) zstd -qdc "$tmp/$path" >"$tmp/out/$name.ko" ;;
            *) cp "$tmp/$path" "$tmp/out/$name.ko" ;;
        esac
        echo "$name" >>"$tmp/out/order"
    done
    grep -qx nf_tables "$tmp/out/order" 2>/dev/null \
        || { echo "kmod/setup.sh: no nf_tables module in linux-image-$KVER" >&2; exit 1; }
    rm -rf "$CACHE/$KVER/modules"
    mv "$tmp/out" "$CACHE/$KVER/modules"
    rm -rf "$tmp"
    trap - EXIT
fi
echo "kmod guest kernel $KVER ($KPKGVER) ready"
