#!/usr/bin/env bash
# CPU per acknowledged message, per service, beside a NATS JetStream server
# doing the same number of deduplicated publishes (the measurement the
# CPU-per-message goals are judged by).
#
# Release build; storage (SQLite), two ingest shards (in-process windows) and
# a gateway as separate processes on loopback, talking mutual TLS
# (`imdedup certs`). For each offered rate, `imdedup-load steady --url ...
# --admin NAME=URL ...` for --duration (10 s) reads each service's
# process_cpu_seconds_total before and after sending. Then nats-server
# (Debian's, installed with apt-get if missing; JetStream, file storage)
# gets the same number of publishes at the same rate from
# bench/jetstream-bench (Go, nats.go), each with a Nats-Msg-Id, 11% of
# them resends of an earlier ID, at most 256 awaiting their PubAck; its CPU
# is read from /proc/<pid>/stat around the publishes. Prints one table row
# per rate: offered, acknowledged/s, p99 ACK, audit, CPU µs per message of
# the gateway, both ingest shards, storage, the services' sum and the driver,
# nats-server's µs per publish, and the ratio services / JetStream.
#
#   bench/cpu-per-message.sh [--rates 1000,3000,6000,13900] [--duration 10]
#                                   [--followers] [--keep] [--profile DIR]
#                                   [--worker-threads 1] [--commit-delay 3ms]
#                                   [--scylla HOST:PORT --redis URL]   (real backends)
#
# IMDEDUP_CPU_NO_BUILD=1 skips the cargo build. About 4 minutes once built.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=bench/release-bins.sh
. bench/release-bins.sh IMDEDUP_CPU_NO_BUILD

if ! command -v nats-server >/dev/null; then
  echo "cpu-per-message: installing nats-server (apt-get)" >&2
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get install -y -q nats-server >/dev/null \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q nats-server >/dev/null; }
fi

bench_dir="${XDG_CACHE_HOME:-$HOME/.cache}/imdedup/jetstream-bench"
mkdir -p "$bench_dir"
(cd bench/jetstream-bench && go build -o "$bench_dir/jetstream-bench" .)

# localprocs.py (the process harness) is shared with the test scenarios.
PYTHONPATH=tests/scenarios${PYTHONPATH:+:$PYTHONPATH} exec python3 bench/cpu_per_message.py \
  --imdedup "$target_dir/release/imdedup" \
  --load "$target_dir/release/imdedup-load" \
  --jetstream-bench "$bench_dir/jetstream-bench" \
  --nats-server "$(command -v nats-server)" \
  "$@"
