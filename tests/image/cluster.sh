#!/usr/bin/env bash
# Runs the imdedup image as a containerised cluster on this machine, loads it
# with imdedup-load from the host, audits it and tears it all down:
#
#   podman network <prefix>-net, pod <prefix>-pod on it (one network
#   namespace, like a Kubernetes pod; the services talk over its loopback)
#     redis       localhost/imdedup-redis:bookworm, :6379 (the ingest shards' window)
#     storage     imdedup storage :7300, embedded SQLite on the volume <prefix>-data
#     ingest-0/1  imdedup ingest :7200 / :7201, IMDEDUP_SHARD_NAME=ingest-N,
#                 the shard map, window in redis
#     gateway     imdedup gateway :7100,
#                 IMDEDUP_SHARDS=ingest-0=http://127.0.0.1:7200,ingest-1=...
#   then  target/release/imdedup-load steady --url ws://127.0.0.1:<port>/v1/ws ...
#
#   tests/image/cluster.sh          # exit 0 iff every service got ready and the audit passed
#
# Why one pod: in this sandbox (gVisor), TCP between two containers across
# the podman bridge stalled under load (inserts from ingest to storage hung
# for tens of seconds), while traffic from the host to a published port did
# not; inside a pod the services meet on loopback.
#
# Every container runs from a read-only root filesystem as a non-root user,
# with all capabilities dropped and no-new-privileges, under runc with the
# ulimits this sandbox allows. Only loopback ports of the host are published:
# the gateway's WebSocket and each service's admin port (for /readyz and
# /metrics), on ports podman picks. Names carry a unique prefix, so runs never
# clash; an EXIT trap stops (SIGTERM, graceful) and removes everything. Logs of
# every container are kept in a temporary directory printed at the end.
#
# Environment: IMDEDUP_IMAGE (default localhost/imdedup:dev),
# IMDEDUP_REDIS_IMAGE (default localhost/imdedup-redis:bookworm),
# IMDEDUP_LOAD_RATE (default 1000 messages/s), IMDEDUP_LOAD_DURATION (20s),
# IMDEDUP_LOAD_USERS (200), IMDEDUP_WS_PORT (default: podman picks one).
# Missing images or binaries are built first with deploy/image/build.sh.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
IMAGE=${IMDEDUP_IMAGE:-localhost/imdedup:dev}
REDIS_IMAGE=${IMDEDUP_REDIS_IMAGE:-localhost/imdedup-redis:bookworm}
RATE=${IMDEDUP_LOAD_RATE:-1000}
DURATION=${IMDEDUP_LOAD_DURATION:-20s}
USERS=${IMDEDUP_LOAD_USERS:-200}
WS_PORT=${IMDEDUP_WS_PORT:-}
READY_TIMEOUT=90
LOAD=$ROOT/target/release/imdedup-load

PREFIX=imdedup-ct-$(date +%s)-$$
NET=$PREFIX-net
POD=$PREFIX-pod
INFRA=$PREFIX-infra
VOLUME=$PREFIX-data
OUT=$(mktemp -d "/tmp/$PREFIX.XXXX")
STARTED=()   # container names, in start order

log() { printf 'cluster: %s\n' "$*" >&2; }
die() { printf 'cluster: ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (rootful podman)"
command -v curl >/dev/null 2>&1 || die "curl is needed for the readiness checks (apt-get install curl)"

# crun refuses this sandbox's cgroup layout, and the hard limits cannot be
# raised past these (see the shared k8s-tooling notes); the containers.conf
# covers the pod's infra container, which `podman run` flags do not reach.
cat >"$OUT/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
[engine]
runtime = "runc"
CONF
export CONTAINERS_CONF=$OUT/containers.conf
pm() { podman --runtime runc "$@"; }
SECURE=(--read-only --cap-drop=ALL --security-opt no-new-privileges
  --ulimit nofile=20000:20000 --ulimit nproc=4096:4096)

# ----------------------------------------------------------------- teardown

teardown() {
  local status=$? name i
  trap - EXIT INT TERM
  # Stop in reverse start order, so each service drains before what it calls.
  for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do
    name=${STARTED[i]}
    pm stop -t 15 "$name" >/dev/null 2>&1 || true
    pm logs "$name" >"$OUT/${name#"$PREFIX"-}.log" 2>&1 || true
    log "stopped ${name#"$PREFIX"-}: exit $(pm inspect --format '{{.State.ExitCode}}' "$name" 2>/dev/null || echo '?')"
    pm rm -f "$name" >/dev/null 2>&1 || true
  done
  pm pod rm -f "$POD" >/dev/null 2>&1 || true
  pm network rm -f "$NET" >/dev/null 2>&1 || true
  pm volume rm -f "$VOLUME" >/dev/null 2>&1 || true
  log "removed containers, pod, network and volume of $PREFIX; logs in $OUT"
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------ helpers

# run SHORTNAME [podman run options...] IMAGE [args...]
run() {
  local short=$1
  shift
  pm run -d --name "$PREFIX-$short" --pod "$POD" "${SECURE[@]}" "$@" >/dev/null
  STARTED+=("$PREFIX-$short")
}

running() { [ "$(pm inspect --format '{{.State.Running}}' "$PREFIX-$1" 2>/dev/null)" = true ]; }

show_logs() { # SHORTNAME
  log "last lines of $1's log:"
  pm logs --tail 30 "$PREFIX-$1" 2>&1 | sed 's/^/    /' >&2 || true
}

# The host address a pod port is published on: 127.0.0.1:NNNNN.
published() { # PORT
  pm port "$INFRA" "$1/tcp" | head -n 1
}

# Waits until http://ADDR/readyz answers 200; fails if the container exits.
wait_ready() { # SHORTNAME ADMIN_PORT
  local short=$1 addr deadline=$((SECONDS + READY_TIMEOUT))
  addr=$(published "$2")
  until curl -fsS -o /dev/null --max-time 2 "http://$addr/readyz" 2>/dev/null; do
    running "$short" || { show_logs "$short"; return 1; }
    [ "$SECONDS" -lt "$deadline" ] || { show_logs "$short"; die "$short not ready after ${READY_TIMEOUT}s"; }
    sleep 0.5
  done
  log "$short ready (admin http://$addr)"
}

# ------------------------------------------------------------------ images

if ! pm image exists "$IMAGE" || ! pm image exists "$REDIS_IMAGE" || [ ! -x "$LOAD" ]; then
  log "image or load driver missing: running deploy/image/build.sh"
  "$ROOT/deploy/image/build.sh" >/dev/null
fi

# --------------------------------------------------------------- the cluster

log "prefix $PREFIX, image $IMAGE"
pm network create "$NET" >/dev/null
pm volume create "$VOLUME" >/dev/null
pm pod create --name "$POD" --infra-name "$INFRA" --network "$NET" \
  -p "127.0.0.1:${WS_PORT}:7100" -p 127.0.0.1::9100 -p 127.0.0.1::9200 \
  -p 127.0.0.1::9201 -p 127.0.0.1::9300 >/dev/null

# No persistence: the window is a cache of recent IDs; /tmp is the tmpfs
# that --read-only provides.
run redis --user redis "$REDIS_IMAGE" --bind 127.0.0.1 --port 6379 \
  --save '' --appendonly no --dir /tmp
deadline=$((SECONDS + READY_TIMEOUT))
until [ "$(pm exec "$PREFIX-redis" redis-cli ping 2>/dev/null)" = PONG ]; do
  running redis || { show_logs redis; die "redis exited"; }
  [ "$SECONDS" -lt "$deadline" ] || { show_logs redis; die "redis not answering"; }
  sleep 0.5
done
log "redis ready"

# Plaintext between the containers of this one-machine check; the chart
# runs mutual TLS (internalTls in values.yaml).
IMDEDUP=(--user 65532:65532 -e IMDEDUP_INSECURE_PLAINTEXT=true "$IMAGE")

# :U makes the fresh volume owned by the container's user (65532).
run storage -v "$VOLUME:/var/lib/imdedup:U" \
  -e IMDEDUP_STORAGE_LISTEN=0.0.0.0:7300 -e IMDEDUP_ADMIN_LISTEN=0.0.0.0:9300 \
  "${IMDEDUP[@]}" storage
wait_ready storage 9300 || die "storage exited"

# The shard map, NAME=URL: the name is the shard's identity for routing and
# its metrics label, and each ingest's IMDEDUP_SHARD_NAME. Given the map, an
# ingest refuses conversations it does not own.
SHARDS=ingest-0=http://127.0.0.1:7200,ingest-1=http://127.0.0.1:7201

for n in 0 1; do
  run "ingest-$n" \
    -e "IMDEDUP_INGEST_LISTEN=0.0.0.0:720$n" -e "IMDEDUP_ADMIN_LISTEN=0.0.0.0:920$n" \
    -e "IMDEDUP_SHARD_NAME=ingest-$n" -e "IMDEDUP_SHARDS=$SHARDS" \
    -e IMDEDUP_STORAGE_URL=http://127.0.0.1:7300 -e IMDEDUP_REDIS_URL=redis://127.0.0.1:6379 \
    "${IMDEDUP[@]}" ingest
done
for n in 0 1; do wait_ready "ingest-$n" "920$n" || die "ingest-$n exited"; done

# A fresh secret per run; passed by name so it never shows in `ps`.
IMDEDUP_TOKEN_SECRET=$(head -c 32 /dev/urandom | base64 | tr -d '/+=')
export IMDEDUP_TOKEN_SECRET
run gateway \
  -e IMDEDUP_GATEWAY_LISTEN=0.0.0.0:7100 -e IMDEDUP_ADMIN_LISTEN=0.0.0.0:9100 \
  -e "IMDEDUP_SHARDS=$SHARDS" -e IMDEDUP_STORAGE_URL=http://127.0.0.1:7300 \
  -e IMDEDUP_TOKEN_SECRET \
  "${IMDEDUP[@]}" gateway
wait_ready gateway 9100 || die "gateway exited"
WS=$(published 7100)

log "containers (user, read-only root, capabilities dropped):"
for name in "${STARTED[@]}"; do
  pm inspect --format "    {{.Name}}  user={{.Config.User}}  read_only={{.HostConfig.ReadonlyRootfs}}  cap_drop={{.HostConfig.CapDrop}}  security_opt={{.HostConfig.SecurityOpt}}" "$name" >&2
done

# ------------------------------------------------------------------ the load

secs=${DURATION%s}
[[ $secs =~ ^[0-9]+$ ]] || secs=60
log "imdedup-load steady at $RATE/s for $DURATION against ws://$WS/v1/ws"
load_status=0
# 1% of sends and of ACKs lost and 1% of messages sent twice at once over
# two connections, so every dedup path runs; the book's resend schedule (0,
# 1, 3, 7, 15 s, give up at 31 s), which rides out the latency spikes of a
# shared 2-core machine. Direct conversations only: this gateway has no
# groups file. The driver stops by itself; timeout is a backstop.
timeout --kill-after=10 $((secs + 120)) "$LOAD" steady \
  --url "ws://$WS/v1/ws" --rate "$RATE" --duration "$DURATION" --users "$USERS" \
  --loss-send 0.01 --loss-ack 0.01 --concurrent-copies 0.01 --group-share 0 \
  --json "$OUT/report.json" --quiet | tee "$OUT/report.txt" || load_status=$?

log "server-side counters:"
for svc in ingest-0:9200 ingest-1:9201 storage:9300 gateway:9100; do
  addr=$(published "${svc##*:}")
  curl -fsS --max-time 5 "http://$addr/metrics" |
    grep -E '^imdedup_(ingest_sends|window_bypassed|store_inserts|gateway_sends|gateway_send_errors|ingest_send_errors)_total' |
    awk -v s="${svc%%:*}" '$NF != 0 { printf "    %-9s %s\n", s, $0 }' >&2 || true
done

for name in "${STARTED[@]}"; do
  running "${name#"$PREFIX"-}" || { show_logs "${name#"$PREFIX"-}"; die "${name#"$PREFIX"-} died during the load"; }
done
[ "$load_status" -eq 0 ] || die "imdedup-load failed (exit $load_status): audit not clean or run broken"
# The audit counts messages that failed on the phone (never ACKed: every try
# answered with an error or lost) without failing on them; a working cluster
# has next to none, a broken one has them all.
read -r messages failed < <(awk '/^  messages / { m = $2 } /failed on the phone/ { f = $NF }
  END { print m + 0, f + 0 }' "$OUT/report.txt")
[ "$messages" -gt 0 ] || die "no message count in the driver's report"
if [ $((failed * 100)) -gt "$messages" ]; then
  die "$failed of $messages messages failed on the phone (more than 1%): the cluster did not serve"
fi
log "audit PASSED, $failed of $messages messages failed on the phone"
