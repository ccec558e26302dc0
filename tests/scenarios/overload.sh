#!/usr/bin/env bash
# Overload scenarios on real Redis + Cassandra: a stalled or slow database,
# and Redis lost on top, must cost some latency, never a resend storm that
# collapses goodput. Each scenario runs on a cluster of its own
# (storage, two ingest shards writing to Cassandra themselves, a gateway;
# separate processes over mutual TLS) in a fresh keyspace, with a private
# Redis, under `imdedup-load steady` (60 phones without network loss that
# resend at 1, 3, 7 and 15 s when no answer comes, come back when a
# retry-after hint says, as gRPC pushback, and give up after 31 s):
#   capacity probe        800/s offered for 8 s: what the cluster acknowledges
#   pause4+redis@50%      the pause4+redis sequence at half the capacity:
#                         Cassandra SIGSTOPped 4 s at 6 s, Redis SIGKILLed at
#                         13 s, back at 17 s
#   pause4+redis@80%      the same at 80% of the capacity
#   pause10@50%           Cassandra paused 10 s
#   slowed@50%            Cassandra stopped 150 ms of every 300 ms for 10 s
#   slowed+redis@50%      the same, with Redis killed and restarted during it
# One line per scenario: messages, lost, repeats, phones that gave up, tries
# per message and their floor (what phones on that schedule must make while
# the database stores nothing), the lowest goodput (acknowledged/s over
# min(offered, capacity)) of any second after the database answers again,
# seconds until p99 is back to its pre-fault level, and the pre-fault p99.
# Each shard's adaptive limit, inserts in flight and sends shed, and the
# gateway's admission limit, sends in flight, refusals and appointments,
# sampled every half second, go to <scenario>.metrics.tsv in the logs
# directory.
# Exits 1 unless every scenario meets the goals (printed last). About 4
# minutes; --short runs the pause4+redis sequence at half the capacity only
# (the suite's version, ~1 minute; it fails on losses, repeats and give-ups).
#
#   tests/scenarios/overload.sh [--short] [--only NAME] [--capacity MSGS_PER_S] [--fresh-db]
#
# --fresh-db restarts that Cassandra before the pause4+redis sequence, which
# then runs on a cold database (the suite does so), at its share of the
# capacity measured on a freshly restarted one (one more probe and restart).
# Uses the Cassandra of tests/services/services.sh (started if not running;
# paused and resumed by this script) and builds target/debug/imdedup and
# imdedup-load unless IMDEDUP_OVERLOAD_NO_BUILD=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ "${IMDEDUP_OVERLOAD_NO_BUILD:-}" != 1 ]; then
  cargo build --locked -q -p imdedup -p imdedup-loadtest
fi
target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null || echo target)

if [ -z "${IMDEDUP_TEST_SCYLLA:-}" ]; then
  eval "$(tests/services/services.sh up --redis --cassandra)"
fi
redis_server=$(command -v redis-server || true)
[ -n "$redis_server" ] || { echo "overload: redis-server is needed (tests/services/services.sh up installs it)" >&2; exit 1; }

exec python3 tests/scenarios/overload.py \
  --imdedup "$target_dir/debug/imdedup" \
  --load "$target_dir/debug/imdedup-load" \
  --redis-server "$redis_server" \
  --scylla "$IMDEDUP_TEST_SCYLLA" \
  "$@"
