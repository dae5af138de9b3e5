#!/usr/bin/env bash
# Boots the pinned Debian kernel (kernel.env) under qemu with the module and the test program, runs one job and
# powers off. The host's own kernel has loadable modules disabled; this is how the module is built and tested
# anyway, in CI too (kernel, headers, qemu: scripts/setup.sh).
#
#   kmod/run-vm.sh check [MiB]        correctness: digests, isolation, accounting, lifetime, errors (tmpl_test.c)
#   kmod/run-vm.sh bench MiB...       map time per template size beside a page-image restore (ratios only)
#   kmod/run-vm.sh criu [MiB]         CRIU dumping a workload tree as a template and restoring copies through the
#                                     module (criu/patches/0012-template-restore.patch; tests/criu_test.c)
#   kmod/run-vm.sh criu-bench MiB...  dump and restore times through the module beside CRIU's CoW and plain ones
#
# The initramfs holds busybox (static), bunshin_tmpl.ko and tmpl_test (static), all built here from the tree into a
# temporary directory (parallel runs do not share one); the criu jobs add the project's CRIU (criu/dist/sbin/criu,
# or BUNSHIN_KMOD_CRIU) with the shared libraries it loads (ldd), the nf_tables modules it probes for (unpacked by
# kmod/setup.sh) and criu_test (static). The guest's init loads the module, runs the job, unloads the
# module, scans the kernel log for BUG/WARNING/Oops/Call Trace and prints one line
#   BUNSHIN_KMOD_RESULT {"insmod_rc": 0, "test_rc": 0, "rmmod_rc": 0, "module_gone": true, "kernel_bad_lines": 0, ...}
# then powers off. Exit status: 0 when that line says everything passed, 1 when it says otherwise, 2 when the VM
# gave no result line (did not boot, panicked or ran past the timeout).
#
# Environment: BUNSHIN_KMOD_ACCEL=tcg|kvm (default tcg, software emulation); BUNSHIN_KMOD_CPU (the TCG CPU model,
# default qemu64: with -cpu max the guest's string and vector instructions are emulated several times slower);
# BUNSHIN_KMOD_TIMEOUT (s, default 120); BUNSHIN_KMOD_MEM (MiB, default 2048); BUNSHIN_KMOD_CACHE (where setup
# unpacked the kernel, default /var/cache/bunshin/kmod); KEEP=1 keeps the work directory.
set -euo pipefail
KMOD=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "run-vm.sh: $*" >&2; exit 2; }

(($#)) || die "usage: run-vm.sh check|criu [MiB] | run-vm.sh bench|criu-bench MiB..."
case $1 in check | bench | criu | criu-bench) ;; *) die "unknown job '$1' (check, bench, criu or criu-bench)" ;; esac
for a in "${@:2}"; do [[ $a =~ ^[0-9]+$ ]] || die "sizes are whole MiB, not '$a'"; done

# shellcheck source=kmod/kernel.env
. "$KMOD/kernel.env"
SUITE=${SUITE:-$(. /etc/os-release; echo "${VERSION_CODENAME:-}")}
kver_var=KVER_$SUITE
[[ -n "${!kver_var:-}" ]] || die "no pinned kernel for Debian suite '$SUITE' (kmod/kernel.env: bookworm, trixie)"
KVER=${!kver_var}
CACHE=${BUNSHIN_KMOD_CACHE:-/var/cache/bunshin/kmod}
KDIR=/usr/src/linux-headers-$KVER
[[ -s $CACHE/$KVER/vmlinux ]] || die "no guest kernel at $CACHE/$KVER/vmlinux; run \`make setup\`"
# The unpacked ELF boots through its PVH entry: no decompression, ~8 s less under software emulation.
KERNEL=$CACHE/$KVER/vmlinux
[[ -f $KDIR/Makefile ]] || die "no headers for $KVER in $KDIR; run \`make setup\`"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found; run \`make setup\`"
command -v cpio >/dev/null || die "cpio not found; run \`make setup\`"
# busybox-static's binary (it conflicts with the dynamic busybox package, so this path is the static one).
BUSYBOX=$(command -v busybox || true)
[[ -n $BUSYBOX ]] && dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' \
    || die "no static busybox (busybox-static); run \`make setup\`"

# TCG by default: it works everywhere, and only ratios are reported. KVM is opt-in: a /dev/kvm that opens is no
# proof that nested virtualisation works (on this project's Firecracker VMs the guest hangs in the firmware).
accel=${BUNSHIN_KMOD_ACCEL:-tcg}
case $accel in
    kvm) accel_args=(-accel kvm -cpu host) ;;
    tcg) accel_args=(-accel tcg,thread=multi -cpu "${BUNSHIN_KMOD_CPU:-qemu64}") ;;
    *) die "BUNSHIN_KMOD_ACCEL must be tcg or kvm, not $accel" ;;
esac

if [[ $1 == criu* ]]; then  # checked before anything is built
    CRIU_BIN=${BUNSHIN_KMOD_CRIU:-$KMOD/../criu/dist/sbin/criu}
    [[ -x $CRIU_BIN ]] || die "no CRIU at $CRIU_BIN; run \`make setup\` (criu/build.sh)"
    # Capture first (as criu/build.sh does): CRIU writes each line apart, grep -q exits at its match, and a later
    # line's write then kills CRIU with SIGPIPE, which pipefail reports as a failed check (the CI run of 1198f2c).
    grep -qx 'Features: tmpl-restore' <<<"$("$CRIU_BIN" --version 2>/dev/null || true)" \
        || die "$CRIU_BIN lacks the template restore (criu/patches/0012-template-restore.patch); rerun criu/build.sh"
    # CRIU's kernel-feature probe needs nf_tables: the modules kmod/setup.sh unpacked, loaded in their order.
    [[ -s $CACHE/$KVER/modules/order ]] || die "no modules for CRIU in $CACHE/$KVER/modules; run \`make setup\`"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/bunshin-kmod-XXXXXX")
cleanup() { if [[ "${KEEP:-0}" == 1 ]]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi; }
trap cleanup EXIT

# The module, built out of the source tree (nothing is written under kmod/).
mkdir -p "$WORK/mod" "$WORK/root/bin" "$WORK/root/dev"
cp "$KMOD/bunshin_tmpl.c" "$KMOD/bunshin_tmpl.h" "$KMOD/Kbuild" "$WORK/mod/"
# No BTF for the module: trixie's headers ship a vmlinux, so kbuild would run pahole (dwarves), which nothing here
# needs; bookworm's ship none and skip it.
make -s -C "$KDIR" M="$WORK/mod" CONFIG_DEBUG_INFO_BTF_MODULES= modules >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log" >&2; die "module build failed"; }
grep -v -E '^(Skipping BTF|  )' "$WORK/build.log" >&2 || true
gcc -static -O2 -Wall -Wextra -Werror -o "$WORK/root/tmpl_test" "$KMOD/tests/tmpl_test.c" \
    || die "tmpl_test build failed"
cp "$WORK/mod/bunshin_tmpl.ko" "$WORK/root/"
prog=/tmpl_test
if [[ $1 == criu* ]]; then
    prog=/criu_test
    gcc -static -O2 -Wall -Wextra -Werror -o "$WORK/root/criu_test" "$KMOD/tests/criu_test.c" \
        || die "criu_test build failed"
    mkdir -p "$WORK/root/criu" "$WORK/root/mods"
    cp "$CACHE/$KVER/modules/order" "$WORK/root/mods/"
    while read -r m; do cp "$CACHE/$KVER/modules/$m.ko" "$WORK/root/mods/"; done <"$CACHE/$KVER/modules/order"
    cp "$CRIU_BIN" "$WORK/root/criu/criu"
    # The loader and every library criu loads, at the paths the loader looks them up at.
    for lib in $(ldd "$CRIU_BIN" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
        mkdir -p "$WORK/root$(dirname "$lib")"
        cp -L "$lib" "$WORK/root$lib"
    done
fi
cp "$BUSYBOX" "$WORK/root/bin/busybox"
printf '%s\n' "$*" >"$WORK/root/job"
echo "$prog" >"$WORK/root/prog"
cat >"$WORK/root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /tmp
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs -o size=75% tmp /tmp
mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo "BUNSHIN_KMOD_BOOTED $(cut -d' ' -f1 /proc/uptime)"
if [ -f /mods/order ]; then
    for m in $(cat /mods/order); do insmod /mods/$m.ko || echo "BUNSHIN_KMOD_DEP insmod $m failed"; done
    mkdir -p /dev/shm && mount -t tmpfs -o size=16m shm /dev/shm  # CRIU's kernel-feature cache (RUNDIR)
    ip link set lo up  # CRIU probes TCP repair over loopback
fi
insmod /bunshin_tmpl.ko
ins=$?
test_rc=99
if [ "$ins" = 0 ]; then
    # stderr goes to the console as it comes (progress, failures); stdout's last line is the job's JSON.
    { $(cat /prog) $(cat /job) >/tmp/out; echo $? >/tmp/rc; } 2>&1 | sed 's/^/TMPL_TEST_STDERR /'
    test_rc=$(cat /tmp/rc)
fi
rmmod bunshin_tmpl
rm_rc=$?
gone=true
grep -q '^bunshin_tmpl ' /proc/modules && gone=false
dmesg >/tmp/dmesg
bad=$(grep -c -E 'BUG|WARNING|Oops|Call Trace' /tmp/dmesg)
grep -E 'BUG|WARNING|Oops|Call Trace|bunshin_tmpl' /tmp/dmesg | sed 's/^/KLOG /'
result=$(tail -n 1 /tmp/out 2>/dev/null)
[ -n "$result" ] || result=null
echo "BUNSHIN_KMOD_RESULT {\"kernel\": \"$(uname -r)\", \"accel\": \"$(sed -n 's/.*bunshin.accel=\([a-z]*\).*/\1/p' /proc/cmdline)\", \"insmod_rc\": $ins, \"test_rc\": $test_rc, \"rmmod_rc\": $rm_rc, \"module_gone\": $gone, \"kernel_bad_lines\": $bad, \"uptime_s\": $(cut -d' ' -f1 /proc/uptime), \"test\": $result}"
poweroff -f
INIT
chmod +x "$WORK/root/init"
(cd "$WORK/root" && find . -print0 | cpio --null -o -H newc --quiet >"$WORK/initramfs.cpio")

# -no-reboot with panic=-1: a kernel panic ends qemu at once instead of rebooting; poweroff -f ends it normally.
start=$(date +%s%N)
set +e
timeout -k 5 "${BUNSHIN_KMOD_TIMEOUT:-120}" qemu-system-x86_64 "${accel_args[@]}" -m "${BUNSHIN_KMOD_MEM:-2048}" \
    -smp 2 -nodefaults -no-user-config -nographic -serial stdio -monitor none -no-reboot -net none \
    -kernel "$KERNEL" -initrd "$WORK/initramfs.cpio" \
    -append "console=ttyS0 panic=-1 loglevel=4 rdinit=/init bunshin.accel=$accel" </dev/null \
    | tee "$WORK/console.log"
qemu_rc=${PIPESTATUS[0]}
set -e
echo "BUNSHIN_KMOD_VM {\"accel\": \"$accel\", \"qemu_rc\": $qemu_rc, \"wall_ms\": $((($(date +%s%N) - start) / 1000000))}"
line=$(grep -a '^BUNSHIN_KMOD_RESULT ' "$WORK/console.log" | tail -n 1 | tr -d '\r' || true)
[[ -n $line ]] || { echo "run-vm.sh: the VM gave no result line (qemu exit $qemu_rc)" >&2; exit 2; }
# Passed: the module loaded and unloaded, the job passed, and the kernel logged no BUG/WARNING/Oops/trace.
grep -q -E '"insmod_rc": 0, "test_rc": 0, "rmmod_rc": 0, "module_gone": true, "kernel_bad_lines": 0,' <<<"$line"
