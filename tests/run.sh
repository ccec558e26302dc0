#!/usr/bin/env bash
# Runs imdedup's whole test suite: starts a real Redis, a 3-master Redis
# Cluster and Apache Cassandra 5.0 (the CQL stand-in for ScyllaDB) on
# loopback with tests/services/services.sh, installing what is missing, runs
# every unit and integration test against the embedded backends and the real
# ones, and stops the services again. This is the README's test command, and
# what CI runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "test: cargo is not on PATH; install Rust with rustup first" >&2
  exit 1
fi

# Habits as code, first (they fail in seconds to minutes): rustfmt,
# clippy with warnings as errors, and no declared dependency left unused
# (cargo-machete, installed once from crates.io).
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -q -- -D warnings
# The suite builds with the `testing` feature (fault injection for the
# fault tests and scenarios); production builds never have it.
cargo clippy --workspace --all-targets --locked -q --features imdedup/testing,imdedup-integration-tests/testing -- -D warnings
if ! command -v cargo-machete >/dev/null 2>&1; then
  cargo install --locked -q cargo-machete@0.9.2
fi
cargo machete
# Every relative link in the Markdown resolves, to a file and a heading
# (a section moved or renamed leaves none behind).
python3 tests/docs/links.py

# Build first, so the services do not sit idle through a cold compile.
cargo test --workspace --locked --features imdedup/testing,imdedup-integration-tests/testing --no-run
# The scenarios below run the binaries themselves (target/debug/imdedup and
# imdedup-load); `cargo test` builds only the ones its own tests need.
cargo build --workspace --locked --features imdedup/testing --bins

# Stop the services at the end only if none were running before.
started_here=0
if [ -z "$(tests/services/services.sh env 2>/dev/null)" ]; then
  started_here=1
fi
stop_services() {
  if [ "$started_here" = 1 ] && [ -z "${IMDEDUP_KEEP_SERVICES:-}" ]; then
    tests/services/services.sh down || true
  fi
}
trap stop_services EXIT

eval "$(tests/services/services.sh up --redis --cassandra --redis-cluster)"
export IMDEDUP_TEST_REDIS_URL IMDEDUP_TEST_SCYLLA IMDEDUP_TEST_REDIS_CLUSTER

cargo test --workspace --locked --features imdedup/testing,imdedup-integration-tests/testing "$@"

# The Helm chart's offline checks: lint, renders validated against the
# Kubernetes and CRD schemas, helm-unittest, and every rendered container's
# args and env through the binary's --check-config (tools install once into
# ~/.cache/imdedup/tools).
tests/chart/chart-test.sh

# The Grafana dashboard and the Prometheus rules, proven against a real
# Prometheus scraping a local cluster under load (installs prometheus once).
# target/debug/imdedup and imdedup-load are built already (above).
IMDEDUP_PROOF_NO_BUILD=1 tests/scenarios/observability-proof.sh

# Past capacity (more load than the service can serve), the short version:
# the load driver's overload scenario on the embedded backends, 4 s surges at
# 1.5x and 3x of a given capacity; fails on a loss, a repeat or a message
# missed by the followers, and prints the per-phase figures (the full run:
# docs/overload.md).
target/debug/imdedup-load overload --embedded --capacity 600 --surge 4s \
  --group-share 0.2 --quiet | grep -v '^overload: per second'

# Fault scenarios under load on Redis + Cassandra, audited with followers:
# failing history writes, an ingest SIGKILLed, a rolling restart, the shard
# map 2 -> 3 -> 2. One line each; every must-be-zero count must be 0.
IMDEDUP_FAULTS_NO_BUILD=1 tests/scenarios/faults.sh

# Overload with a stalled database, the short version: Cassandra restarted
# and the capacity of a cluster measured on it, then the pause4+redis
# sequence on that database at half of it: Cassandra paused 4 s, Redis killed and
# restarted; fails on a loss, a repeat or a phone giving up, and prints the
# goodput, recovery and tries figures. Last in the suite, as it restarts the
# shared Cassandra. The full set: tests/scenarios/overload.sh.
IMDEDUP_OVERLOAD_NO_BUILD=1 tests/scenarios/overload.sh --short --fresh-db
