#!/usr/bin/env bash
# Debian's Docker engine (docker.io), installed when missing and started by hand when not running (these machines
# have no init system to start it). Idempotent; seconds when it already runs. Used by setup.sh: the image import
# tests (Image.from_docker) and the peer benchmark need a real engine. The daemon gets no bridge and no iptables
# rules (--bridge=none --iptables=false): nothing of the host's network is changed, containers run with
# --network=none or --network=host. Note: a second daemon started with --bridge=none deletes an existing docker0, so
# a daemon that already answers is always reused.
set -euo pipefail
log() { echo "==> $*"; }
SOCK=${DOCKER_SOCK:-/var/run/docker.sock}
LOG=${DOCKERD_LOG:-/var/log/bunshin-dockerd.log}

if [[ "$(dpkg-query -W -f='${Status}' docker.io 2>/dev/null || true)" != "install ok installed" ]]; then
    log "installing docker.io"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends docker.io >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends docker.io >/dev/null; }
fi
# /usr/bin/docker is Debian's client for this daemon (another docker on PATH may be a different client).
DOCKER=/usr/bin/docker
up() { "$DOCKER" -H "unix://$SOCK" version --format '{{.Server.Version}}' >/dev/null 2>&1; }
if up; then
    echo "dockerd running"
    exit 0
fi
log "starting dockerd (log: $LOG)"
# setsid: the daemon outlives this script and the make run that called it.
setsid /usr/sbin/dockerd -H "unix://$SOCK" --iptables=false --ip6tables=false --bridge=none \
    </dev/null >>"$LOG" 2>&1 &
for _ in $(seq 1 300); do
    up && { echo "dockerd up"; exit 0; }
    sleep 0.1
done
tail -20 "$LOG" >&2
echo "docker.sh: dockerd did not answer on $SOCK within 30 s" >&2
exit 1
