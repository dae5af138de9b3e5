#!/usr/bin/env bash
# Starts Debian's Docker engine (docker.io, installed by setup.sh) by hand when it is not running (these machines
# have no init system to start it). Idempotent; seconds when it already runs. Used by setup.sh: the image import
# tests (Image.from_docker) and the peer benchmark need a real engine. The daemon gets no bridge and no iptables
# rules (--bridge=none --iptables=false): nothing of the host's network is changed, containers run with
# --network=none or --network=host. Note: a second daemon started with --bridge=none deletes an existing docker0, so
# a daemon that already answers is always reused.
set -euo pipefail
log() { echo "==> $*"; }
SOCK=${DOCKER_SOCK:-/var/run/docker.sock}
LOG=${DOCKERD_LOG:-/var/log/bunshin-dockerd.log}

command -v dockerd >/dev/null || { echo "docker.sh: dockerd not found: apt-get install docker.io (scripts/setup.sh does)" >&2; exit 1; }
# /usr/bin/docker is Debian's client for this daemon (another docker on PATH may be a different client).
DOCKER=/usr/bin/docker
up() { "$DOCKER" -H "unix://$SOCK" version --format '{{.Server.Version}}' >/dev/null 2>&1; }
if [[ -n "${BUNSHIN_DOCKER_NO_START:-}" ]]; then
    echo "skipped (clean-root check): starting dockerd (a second daemon on the host's kernel)"
    exit 0
fi
if up; then
    echo "dockerd running"
    exit 0
fi
log "starting dockerd (log: $LOG)"
# setsid: the daemon outlives this script and the make run that called it.
# --experimental enables `docker checkpoint` (the peer benchmark compares it with BunshinFork); runc finds CRIU on
# the daemon's PATH, so the project's CRIU 4.2.1 goes first (Debian 12's criu 3.17 fails on newer kernels).
CRIU_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/criu/dist/sbin
# The daemon's own temporary directory: containerd 1.6 (Debian 12's) leaves every `docker checkpoint create`'s CRIU
# images in its temporary directory, /tmp/ctrd-checkpoint<N> (containerd#10166); in a directory only this daemon
# writes, the peer benchmark can remove them without touching anybody else's.
TMP_DIR=${BUNSHIN_DOCKER_TMPDIR:-/var/lib/bunshin-docker/tmp}
install -d -m 0700 "$TMP_DIR"
# The daemon gets no descriptor of its caller's beyond 0-2: one inherited (a `flock` on a lock file around
# `make setup`) would be held for the daemon's life.
(
    for fd in /proc/$BASHPID/fd/*; do
        fd=${fd##*/}
        if [[ $fd -gt 2 ]]; then eval "exec $fd>&-"; fi
    done
    PATH="$CRIU_DIR:$PATH" TMPDIR="$TMP_DIR" exec setsid /usr/sbin/dockerd -H "unix://$SOCK" --iptables=false --ip6tables=false \
        --bridge=none --experimental </dev/null >>"$LOG" 2>&1
) &
for _ in $(seq 1 300); do
    up && { echo "dockerd up"; exit 0; }
    sleep 0.1
done
tail -20 "$LOG" >&2
echo "docker.sh: dockerd did not answer on $SOCK within 30 s" >&2
exit 1
