#!/usr/bin/env bash
# The README's two commands in a clean Debian root, as a new user would run them: debootstrap a
# minimal Debian (default: 13, trixie), clone this repository into it, and run `make demo`, then
# `make test`, as root in a chroot, with pip knowing only PyPI (no local wheel folder, no pip
# configuration) and no cache from this machine. Each command's wall time and exit status go to
# $OUT/times.txt, its output to $OUT/<command>.log.
#
#   sudo bash scripts/install/debian_root.sh                 # /srv/deb13, logs in build/debian_root
#   SUITE=bookworm TARGET=/srv/deb12 sudo bash scripts/install/debian_root.sh
#   STEPS=demo sudo bash scripts/install/debian_root.sh      # only make demo
#
# Environment: SUITE (trixie), TARGET (/srv/deb13), MIRROR (http://deb.debian.org/debian),
# OUT (build/debian_root), STEPS ("demo test"), NICE (19: the root's commands run at this niceness).
# Needs root, debootstrap (installed if missing) and a few GB of disk; nothing else of this
# machine is used (a fresh root is made when TARGET does not hold one yet).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SUITE=${SUITE:-trixie}
TARGET=${TARGET:-/srv/deb13}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
OUT=$(mkdir -p "${OUT:-$ROOT/build/debian_root}" && cd "${OUT:-$ROOT/build/debian_root}" && pwd)
STEPS=${STEPS:-demo test}
NICE=${NICE:-19}

[[ $(id -u) -eq 0 ]] || { echo "run as root (debootstrap and chroot need it)" >&2; exit 2; }
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/times.txt"; }

if ! command -v debootstrap >/dev/null; then
    apt-get update -q && apt-get install -y -q debootstrap
fi
if [[ ! -x "$TARGET/usr/bin/apt-get" ]]; then
    log "debootstrap --variant=minbase $SUITE $TARGET"
    start=$SECONDS
    debootstrap --variant=minbase "$SUITE" "$TARGET" "$MIRROR" >"$OUT/debootstrap.log" 2>&1
    log "debootstrap: $((SECONDS - start)) s"
fi

mounts=(proc sys dev dev/pts)
cleanup() {
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        mountpoint -q "$TARGET/${mounts[$i]}" && umount -l "$TARGET/${mounts[$i]}" || true
    done
}
trap cleanup EXIT
mount -t proc proc "$TARGET/proc"
mount --rbind /sys "$TARGET/sys"
mount --bind /dev "$TARGET/dev"
mount --bind /dev/pts "$TARGET/dev/pts"
cp /etc/resolv.conf "$TARGET/etc/resolv.conf"
# The Debian installer names the machine in /etc/hosts (127.0.1.1); debootstrap does not, and gloo
# (torchrun, horovodrun --gloo) resolves the host name to find its interface.
grep -qw "$(hostname)" "$TARGET/etc/hosts" || echo "127.0.1.1	$(hostname)" >>"$TARGET/etc/hosts"

# A network that inspects TLS (as this machine's does) signs with a CA of its own: the root trusts
# the certificates this machine added (/usr/local/share/ca-certificates), and pip reads the system
# store (PIP_CERT; a venv's pip otherwise trusts its own bundle only). A user's machine needs neither.
in_root() { chroot "$TARGET" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 PIP_CONFIG_FILE=/dev/null PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt "$@"; }
mkdir -p "$TARGET/usr/local/share/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$TARGET/usr/local/share/ca-certificates/" 2>/dev/null || true
# What a minimal root lacks that the README assumes a user has: make, git and certificates (the
# install adds everything else it needs, Python's venv and headers included).
log "prerequisites: apt-get install make git ca-certificates python3"
in_root bash -c "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q make git ca-certificates python3 \
    && update-ca-certificates" >"$OUT/prerequisites.log" 2>&1
log "$(in_root python3 --version) in $(in_root cat /etc/debian_version)"

rm -rf "$TARGET/root/horovod-alq"
git clone -q "$ROOT" "$TARGET/root/horovod-alq"
log "cloned $(git -C "$ROOT" rev-parse --short HEAD) into $TARGET/root/horovod-alq"

for step in $STEPS; do
    log "make $step: start"
    start=$SECONDS
    rc=0
    in_root nice -n "$NICE" bash -c "cd /root/horovod-alq && make $step; rc=\$?; times; exit \$rc" >"$OUT/$step.log" 2>&1 || rc=$?
    log "make $step: rc $rc, $((SECONDS - start)) s wall; CPU of its processes (user, system): $(tail -1 "$OUT/$step.log")"
    [[ $rc -eq 0 ]] || break
done
