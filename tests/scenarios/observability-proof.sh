#!/usr/bin/env bash
# Proof that the Grafana dashboard (deploy/grafana/imdedup-dashboard.json) and
# the Prometheus rules (deploy/prometheus/imdedup-rules.yaml) work against a
# real Prometheus: part of the test suite (tests/run.sh runs it after
# the cargo tests).
#
# It checks the rules with promtool (check + the unit tests in
# imdedup-rules.test.yaml) and the dashboard's structure, starts storage, two
# ingest shards on their own Redis, and a gateway as separate processes on
# loopback, plus a Prometheus scraping their admin ports every second with the
# rules loaded; drives load with duplicates through the gateway (pausing Redis,
# restarting storage and locking the database for a moment, so the error
# series exist); then evaluates every dashboard query and every rule through
# Prometheus's HTTP API and compares the dedup hit rate with the load driver's
# own counts (within 1%). The logic is in observability_proof.py next to this
# script. About 45 s.
#
# Installs Debian's prometheus (and redis-server) with apt-get when missing,
# without starting their system services. Builds target/debug/imdedup and
# imdedup-load unless IMDEDUP_PROOF_NO_BUILD=1.
#
#   tests/scenarios/observability-proof.sh [--keep]     # --keep: keep the temp dir (logs, TSDB)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

log() { printf 'proof: %s\n' "$*" >&2; }
die() { printf 'proof: ERROR: %s\n' "$*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
  else die "need root to run: $*"; fi
}

apt_install() { # PKG...
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install $* yourself"
  local alog policy_added=0
  alog=$(mktemp -t imdedup-proof-apt.XXXXXX)
  # Keep the packages' system services from starting (they would listen on
  # :9090 / :6379): policy-rc.d exit 101 means "not allowed", for invoke-rc.d.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
    as_root chmod +x /usr/sbin/policy-rc.d
    policy_added=1
  fi
  log "apt-get install $*"
  if ! { as_root apt-get update -q && as_root env DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -q --no-install-recommends "$@"; } >"$alog" 2>&1; then
    [ "$policy_added" = 1 ] && as_root rm -f /usr/sbin/policy-rc.d
    tail -n 20 "$alog" >&2
    die "apt-get install $* failed (log: $alog)"
  fi
  [ "$policy_added" = 1 ] && as_root rm -f /usr/sbin/policy-rc.d
  rm -f "$alog"
}

missing=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ "${#missing[@]}" -eq 0 ] || apt_install "${missing[@]}"
command -v python3 >/dev/null 2>&1 || die "python3 not found"

if [ "${IMDEDUP_PROOF_NO_BUILD:-}" != 1 ]; then
  cargo build --locked -q -p imdedup -p imdedup-loadtest
fi
target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null || echo target)
for bin in imdedup imdedup-load; do
  [ -x "$target_dir/debug/$bin" ] || die "$target_dir/debug/$bin not found; build with: cargo build -p imdedup -p imdedup-loadtest"
done

exec python3 tests/scenarios/observability_proof.py \
  --imdedup "$target_dir/debug/imdedup" \
  --load "$target_dir/debug/imdedup-load" \
  --rules deploy/prometheus/imdedup-rules.yaml \
  --rules-test deploy/prometheus/imdedup-rules.test.yaml \
  --dashboard deploy/grafana/imdedup-dashboard.json \
  "$@"
