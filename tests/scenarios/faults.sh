#!/usr/bin/env bash
# Fault scenarios under load on real Redis + Cassandra, each audited with
# followers (readers that follow every conversation with a cursor, as
# receiving phones do). Part of the test suite (tests/run.sh).
#
# Four scenarios, each on a cluster of its own (storage, two ingest shards
# writing to Cassandra themselves, a gateway; separate processes on
# loopback), with `imdedup-load steady` driving the gateway:
#   history-write-failing  5% of the writes that publish a stored message fail
#                          (the ingest's hidden fault knob), so rows stay
#                          pending until the phone's resend settles them
#   ingest-sigkill         ingest-1 is SIGKILLed mid-run and restarted
#   rolling-restart        storage, each ingest and the gateway restarted in turn
#   shards-2-3-2           the shard map goes 2 -> 3 -> 2 while sending
# One line per scenario: messages, lost, repeats, missed by followers,
# reordered, seq order violations, failed on the phone. Exits 1 unless every
# must-be-zero count is 0. About 3 minutes.
#
#   tests/scenarios/faults.sh [--rate 200] [--duration 20] [--only NAME]
#   tests/scenarios/faults.sh --cassandra-cluster   (the database's faults, below)
#   tests/scenarios/faults.sh --redis-cluster       (a Redis master killed, below)
#
# With --cassandra-cluster, five other scenarios run on services.sh's opt-in
# three-node Cassandra cluster (RF 3, LOCAL_QUORUM, LOCAL_SERIAL), not in the
# suite, each after 10 s of unaudited load that warms the nodes up: no-fault,
# node-sigkill (node3 killed, back later), node-pause (node2 SIGSTOPped for
# 10 s, like a long GC pause), two-nodes-down (node2 and node3 killed and
# restarted 6 s later; no quorum until they are back, about 24 s here),
# node-restart-2-3-shards (node3 stopped and started again while a third
# ingest shard joins and every service rolls onto the new map).
#
# With --redis-cluster, one scenario runs on services.sh's Redis Cluster
# (three masters, a replica each), not in the suite: redis-master-killed (a
# master SIGKILLed mid-run; the window is bypassed until its replica takes
# over the slots, about 5-7 s with the harness's 5 s node timeout).
#
# Uses the services of tests/services/services.sh (started if not running) and
# builds target/debug/imdedup (with the `testing` feature: the fault-injection
# flags) and imdedup-load unless IMDEDUP_FAULTS_NO_BUILD=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ "${IMDEDUP_FAULTS_NO_BUILD:-}" != 1 ]; then
  cargo build --locked -q -p imdedup -p imdedup-loadtest --features imdedup/testing
fi
target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null || echo target)

scylla=${IMDEDUP_TEST_SCYLLA:-}
case " $* " in
  *" --cassandra-cluster "*)
    # The database faults run on the opt-in three-node cluster.
    eval "$(tests/services/services.sh up --redis --cassandra-cluster)"
    scylla=$IMDEDUP_TEST_SCYLLA_CLUSTER
    export IMDEDUP_CASSANDRA_CLUSTER_DIR
    ;;
  *" --redis-cluster "*)
    # A Redis master killed: the window on services.sh's Redis Cluster.
    eval "$(tests/services/services.sh up --redis --cassandra --redis-cluster)"
    scylla=$IMDEDUP_TEST_SCYLLA
    IMDEDUP_TEST_REDIS_URL=$IMDEDUP_TEST_REDIS_CLUSTER
    ;;
  *)
    if [ -z "${IMDEDUP_TEST_REDIS_URL:-}" ] || [ -z "$scylla" ]; then
      eval "$(tests/services/services.sh up --redis --cassandra)"
      scylla=$IMDEDUP_TEST_SCYLLA
    fi
    ;;
esac

exec python3 tests/scenarios/faults.py \
  --imdedup "$target_dir/debug/imdedup" \
  --load "$target_dir/debug/imdedup-load" \
  --redis "$IMDEDUP_TEST_REDIS_URL" \
  --scylla "$scylla" \
  "$@"
