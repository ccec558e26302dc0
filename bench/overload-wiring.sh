#!/usr/bin/env bash
# The load driver's overload scenario (docs/overload.md) on the
# separate-process wiring: storage (SQLite), two ingest shards and a gateway
# as processes of their own on loopback over mutual TLS, one tokio worker
# each, as bench/cpu-per-message.sh starts them; then
# `imdedup-load overload` against the gateway with every service's admin
# URL, so its per-second table has the services' CPU. Its last line:
# `overload: capacity C/s; at 1.5x goodput G1% of C, tries T1, gave up F1;
# at 3x goodput G3% of C, tries T3, gave up F3`.
#
#   bench/overload-wiring.sh [--worker-threads 1] [--commit-delay 3ms]
#                            [--scylla HOST:PORT --redis URL] [--keep]
#                            [--pin] [-- DRIVER FLAGS]
#
# DRIVER FLAGS default to `--group-share 0 --no-followers` (the driver then
# searches the capacity first); e.g. `-- --group-share 0 --no-followers
# --capacity 6061 --surge 20s`. IMDEDUP_OVERLOAD_NO_BUILD=1 skips the cargo
# build. About 3 minutes with --capacity, longer with the search. --pin puts
# the four services on the first CPU and the driver on the second: the
# driver's CPU grows with what it offers (about three times at 3x), and
# unpinned it is taken from the services, so C and the surges measure the
# box rather than the services.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=bench/release-bins.sh
. bench/release-bins.sh IMDEDUP_OVERLOAD_NO_BUILD

# localprocs.py (the process harness) is shared with the test scenarios.
PYTHONPATH=bench:tests/scenarios${PYTHONPATH:+:$PYTHONPATH} exec python3 bench/overload_wiring.py \
  --imdedup "$target_dir/release/imdedup" \
  --load "$target_dir/release/imdedup-load" \
  "$@"
