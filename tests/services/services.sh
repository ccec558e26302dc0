#!/usr/bin/env bash
# Local services harness for imdedup tests: Redis, a 3-master Redis Cluster and
# a single-node Apache Cassandra 5.0 (CQL stand-in for ScyllaDB), all on
# 127.0.0.1. See tests/services/README.md.
#
#   services.sh up [--redis] [--cassandra] [--redis-cluster] [--cassandra-cluster]
#                  (default: redis + cassandra; --cassandra-cluster: three
#                  Cassandra nodes on 127.0.0.1-3, opt-in, also restarts a
#                  node of it that was stopped, keeping its data)
#   services.sh down [--purge]
#   services.sh status
#   services.sh env
#   services.sh cql 'STATEMENT' ['STATEMENT' ...]
#   services.sh flush-cluster   (every node of the cluster writes its schema and
#                  memtables to disk: nodetool flush over local JMX)
#
# Human-readable progress goes to stderr; `up` and `env` print only `export`
# lines on stdout, so `eval "$(tests/services/services.sh up)"` works.
# shellcheck disable=SC2016,SC2013  # single-quoted bash -c scripts and word-split port lists are intended
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${IMDEDUP_CACHE:-${HOME:-/tmp}/.cache/imdedup}
STATE=${IMDEDUP_STATE:-/tmp/imdedup-services}
HOST=127.0.0.1

REDIS_PORT=${IMDEDUP_REDIS_PORT:-6390}
CLUSTER_BASE_PORT=${IMDEDUP_REDIS_CLUSTER_PORT:-7101}   # uses PORT..PORT+5 and bus ports +10000
CQL_PORT=${IMDEDUP_CQL_PORT:-9142}
CASS_STORAGE_PORT=${IMDEDUP_CASSANDRA_STORAGE_PORT:-7190}
CASS_JMX_PORT=${IMDEDUP_CASSANDRA_JMX_PORT:-}            # empty: JMX disabled
CASS_VERSION=${IMDEDUP_CASSANDRA_VERSION:-5.0.9}
CASS_XMS=${IMDEDUP_CASSANDRA_XMS:-256m}
CASS_XMX=${IMDEDUP_CASSANDRA_XMX:-1g}
CASS_KEEP_DATA=${IMDEDUP_CASSANDRA_KEEP_DATA:-0}
CASS_MLOCK=${IMDEDUP_CASSANDRA_MLOCK:-0}                 # 1: let Cassandra mlockall() its memory
# The opt-in three-node cluster: one node per loopback address, the same ports.
CLUSTER_CQL_PORT=${IMDEDUP_CLUSTER_CQL_PORT:-9242}
CLUSTER_STORAGE_PORT=${IMDEDUP_CLUSTER_STORAGE_PORT:-7290}
CLUSTER_XMX=${IMDEDUP_CLUSTER_XMX:-768m}
CLUSTER_JMX_PORT=${IMDEDUP_CLUSTER_JMX_PORT:-7391}       # node i (0-2) on 127.0.0.1:PORT+i, for flush-cluster
CLUSTER_HOSTS=(127.0.0.1 127.0.0.2 127.0.0.3)
# Evenly spread single tokens, so each node owns a third before replication.
CLUSTER_TOKENS=(-9223372036854775808 -3074457345618258603 3074457345618258602)
START_TIMEOUT=${IMDEDUP_START_TIMEOUT:-180}
STOP_TIMEOUT=${IMDEDUP_STOP_TIMEOUT:-30}

log() { printf 'services: %s\n' "$*" >&2; }
die() { printf 'services: ERROR: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { LC_ALL=C awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

usage() {
  sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

# ---------------------------------------------------------------- utilities

port_open() { # PORT -> 0 if something accepts TCP connections on HOST:PORT
  timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$HOST" "$1" 2>/dev/null
}

require_free_port() { # PORT ENVVAR
  if port_open "$1"; then
    die "port $HOST:$1 is already in use by a process this harness did not start; stop it or set $2 to another port"
  fi
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
  else die "need root to run: $*"; fi
}

APT_UPDATED=0
apt_install() { # PKG...
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install manually: $*"
  local alog="$STATE/apt.log"
  if [ "$APT_UPDATED" = 0 ]; then
    log "apt-get update"
    as_root apt-get update -q >"$alog" 2>&1 || { sleep 5; as_root apt-get update -q >>"$alog" 2>&1; } \
      || { tail -n 20 "$alog" >&2; die "apt-get update failed (log: $alog)"; }
    APT_UPDATED=1
  fi
  log "apt-get install $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >>"$alog" 2>&1 \
    || { tail -n 20 "$alog" >&2; die "apt-get install $* failed (log: $alog)"; }
}

# pid file helpers: every process we start has DIR/pid, and its /proc cmdline
# is checked so that a recycled pid is never mistaken for ours.
#   pid_of DIR redis PORT | pid_of DIR cassandra  -> prints the pid if alive and ours
pid_of() {
  local f="$1/pid" pid cl
  [ -s "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  cl=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  case "$2" in
    # before Redis rewrites its title: "redis-server --port P ..."; after: "redis-server 127.0.0.1:P"
    redis) [[ "$cl" == *redis* && "$cl " =~ [:\ ]$3[\ ] ]] || return 1 ;;
    cassandra) [[ "$cl" == *" -Dcassandra.storagedir=$1 "* ]] || return 1 ;;
    *) return 1 ;;
  esac
  printf '%s\n' "$pid"
}

start_bg() { # DIR LOGFILE CMD... : start detached (own session, cwd DIR), pid in DIR/pid
  local dir=$1 logf=$2; shift 2
  rm -f "$dir/pid"
  # The server must not keep any of our descriptors: fd 9 is our lock, and an
  # inherited pipe would make `$(services.sh up)` wait for the server to exit.
  # So stdio goes to the log and every other inherited fd is closed.
  setsid bash -c 'for n in $(ls /proc/$$/fd); do [ "$n" -gt 2 ] && exec {n}>&-; done
    cd "$1" && echo $$ >"$1/pid" && shift && exec "$@"' start_bg "$dir" "$@" \
    </dev/null >>"$logf" 2>&1 9>&- &
  local i
  for i in $(seq 1 50); do [ -s "$dir/pid" ] && return 0; sleep 0.1; done
  die "could not start $1 (no pid file)"
}

stop_pid() { # PID NAME TIMEOUT [nosignal] : TERM, wait, then KILL
  local pid=$1 name=$2 t=$3 i
  if [ "${4:-}" != nosignal ]; then kill -TERM "$pid" 2>/dev/null || return 0; fi
  for i in $(seq 1 $((t * 10))); do
    kill -0 "$pid" 2>/dev/null || { log "$name stopped (pid $pid)"; return 0; }
    sleep 0.1
  done
  log "$name did not exit within ${t}s; sending SIGKILL (pid $pid)"
  kill -KILL "$pid" 2>/dev/null || true
  for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  log "WARNING: $name (pid $pid) still alive after SIGKILL"
}

lock() {
  mkdir -p "$STATE"
  exec 9>"$STATE/.lock"
  flock -w 900 9 || die "timed out waiting for lock $STATE/.lock (another services.sh running?)"
}

# ---------------------------------------------------------------- redis

ensure_redis_bin() {
  if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    apt_install redis-server redis-tools
    command -v redis-server >/dev/null 2>&1 || die "redis-server still not on PATH after install"
  fi
}

rcli() { timeout 10 redis-cli -h "$HOST" "$@"; }
redis_ping() { [ "$(rcli -p "$1" ping 2>/dev/null)" = PONG ]; }

redis_start_node() { # DIR PORT [EXTRA ARGS...]
  local dir=$1 port=$2; shift 2
  mkdir -p "$dir"
  echo "$port" >"$dir/port"
  start_bg "$dir" "$dir/redis.log" redis-server --port "$port" --bind "$HOST" \
    --save '' --appendonly no --daemonize no --dir "$dir" --logfile '' \
    --protected-mode yes "$@"
}

redis_wait() { # DIR PORT NAME
  local deadline=$((SECONDS + 30))
  while :; do
    redis_ping "$2" && return 0
    pid_of "$1" redis "$2" >/dev/null || { tail -n 20 "$1/redis.log" >&2; die "$3 exited during startup (log: $1/redis.log)"; }
    [ "$SECONDS" -lt "$deadline" ] || die "$3 not answering PING on port $2 after 30s (log: $1/redis.log)"
    sleep 0.1
  done
}

up_redis() {
  local dir="$STATE/redis" port
  port=$(cat "$dir/port" 2>/dev/null || echo "$REDIS_PORT")
  if pid_of "$dir" redis "$port" >/dev/null && redis_ping "$port"; then
    log "redis already running on $HOST:$port"
    return 0
  fi
  ensure_redis_bin
  local pid
  if pid=$(pid_of "$dir" redis "$port"); then stop_pid "$pid" redis 10; fi
  port=$REDIS_PORT
  require_free_port "$port" IMDEDUP_REDIS_PORT
  rm -rf "$dir"
  local t0; t0=$(now)
  redis_start_node "$dir" "$port"
  redis_wait "$dir" "$port" redis
  log "redis ready on $HOST:$port ($(elapsed "$t0")s)"
}

# Three masters, each with a replica (so a master killed is replaced by its
# replica, as in a deployed Redis Cluster).
cluster_default_ports() { seq -s ' ' "$CLUSTER_BASE_PORT" "$((CLUSTER_BASE_PORT + 5))"; }

cluster_ports() { # from state if present, else from env
  local f="$STATE/redis-cluster/ports"
  if [ -s "$f" ]; then cat "$f"; else cluster_default_ports; fi
}

cluster_healthy() {
  local p
  for p in $(cluster_ports); do
    pid_of "$STATE/redis-cluster/$p" redis "$p" >/dev/null || return 1
    rcli -p "$p" cluster info 2>/dev/null | tr -d '\r' | grep -qx 'cluster_state:ok' || return 1
  done
}

up_redis_cluster() {
  local base="$STATE/redis-cluster" p pid
  if [ -s "$base/ports" ] && cluster_healthy; then
    log "redis cluster already running on ports $(cluster_ports)"
    return 0
  fi
  ensure_redis_bin
  local old=()
  for p in $(cluster_ports); do
    if pid=$(pid_of "$base/$p" redis "$p"); then kill -TERM "$pid" 2>/dev/null || true; old+=("$pid:$p"); fi
  done
  for pid in ${old[@]+"${old[@]}"}; do stop_pid "${pid%%:*}" "redis-cluster:${pid#*:}" 10 nosignal; done
  rm -rf "$base"
  local ports; ports=$(cluster_default_ports)
  for p in $ports; do
    require_free_port "$p" IMDEDUP_REDIS_CLUSTER_PORT
    require_free_port "$((p + 10000))" IMDEDUP_REDIS_CLUSTER_PORT
  done
  mkdir -p "$base"
  echo "$ports" >"$base/ports"
  local t0; t0=$(now)
  for p in $ports; do
    redis_start_node "$base/$p" "$p" --cluster-enabled yes \
      --cluster-config-file "$base/$p/nodes.conf" --cluster-node-timeout 5000
  done
  local addrs=()
  for p in $ports; do redis_wait "$base/$p" "$p" "redis-cluster:$p"; addrs+=("$HOST:$p"); done
  timeout 60 redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes \
    >"$base/create.log" 2>&1 || { tail -n 20 "$base/create.log" >&2; die "redis-cli --cluster create failed (log: $base/create.log)"; }
  local deadline=$((SECONDS + 30))
  until cluster_healthy; do
    [ "$SECONDS" -lt "$deadline" ] || die "redis cluster not in cluster_state:ok after 30s (logs: $base/*/redis.log)"
    sleep 0.2
  done
  log "redis cluster ready on ports $ports ($(elapsed "$t0")s)"
}

# ---------------------------------------------------------------- java / cassandra

java_major() { # JAVA -> major version
  "$1" -XshowSettings:properties -version 2>&1 | awk -F'= ' '/java.specification.version/ { print $2; exit }'
}

JAVA=""
ensure_java() {
  [ -n "$JAVA" ] && return 0
  local c cands=()
  [ -n "${IMDEDUP_JAVA_HOME:-}" ] && cands+=("$IMDEDUP_JAVA_HOME/bin/java")
  [ -n "${JAVA_HOME:-}" ] && cands+=("$JAVA_HOME/bin/java")
  command -v java >/dev/null 2>&1 && cands+=("$(command -v java)")
  for c in /usr/lib/jvm/*17*/bin/java; do cands+=("$c"); done
  for c in "${cands[@]}"; do
    [ -x "$c" ] || continue
    if [ "$(java_major "$c")" = 17 ]; then JAVA=$(readlink -f "$c"); break; fi
  done
  if [ -z "$JAVA" ]; then
    apt_install openjdk-17-jdk-headless
    for c in /usr/lib/jvm/*17*/bin/java; do
      if [ -x "$c" ] && [ "$(java_major "$c")" = 17 ]; then JAVA=$(readlink -f "$c"); break; fi
    done
    [ -n "$JAVA" ] || die "no Java 17 found (Cassandra $CASS_VERSION needs Java 17); set IMDEDUP_JAVA_HOME"
  fi
}

CASS_CP=""
ensure_cassandra_dist() { # resolves cassandra-all + runtime deps into the cache, sets CASS_CP
  local d="$CACHE/cassandra-$CASS_VERSION" cpf
  cpf="$d/classpath.txt"
  if [ -s "$cpf" ] && [ -f "$d/.complete" ]; then
    CASS_CP=$(cat "$cpf")
    local j ok=1 IFS=:
    for j in $CASS_CP; do [ -f "$j" ] || { ok=0; break; }; done
    unset IFS
    [ "$ok" = 1 ] && return 0
    log "cached Cassandra classpath is stale; resolving again"
  fi
  command -v mvn >/dev/null 2>&1 || apt_install maven
  mkdir -p "$d"
  rm -f "$d/.complete"
  cat >"$d/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>imdedup.local</groupId>
  <artifactId>cassandra-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.cassandra</groupId>
      <artifactId>cassandra-all</artifactId>
      <version>$CASS_VERSION</version>
    </dependency>
  </dependencies>
</project>
EOF
  log "fetching Cassandra $CASS_VERSION and its dependencies with Maven into $CACHE (first run only)"
  local t0; t0=$(now)
  local try ok=0
  for try in 1 2; do
    if JAVA_HOME=$(dirname "$(dirname "$JAVA")") timeout 900 mvn -B -q -f "$d/pom.xml" \
        -Dmaven.repo.local="$CACHE/m2" \
        org.apache.maven.plugins:maven-dependency-plugin:3.6.1:build-classpath \
        -Dmdep.includeScope=runtime -Dmdep.outputFile="$cpf.tmp" >"$d/mvn.log" 2>&1; then
      ok=1; break
    fi
    [ "$try" = 2 ] || { log "Maven failed; retrying once"; sleep 5; }
  done
  if [ "$ok" = 0 ]; then
    tail -n 30 "$d/mvn.log" >&2
    die "Maven could not fetch org.apache.cassandra:cassandra-all:$CASS_VERSION (log: $d/mvn.log)"
  fi
  mv "$cpf.tmp" "$cpf"
  CASS_CP=$(cat "$cpf")
  case ":$CASS_CP:" in *cassandra-all-"$CASS_VERSION".jar:*) ;; *) die "cassandra-all jar missing from resolved classpath ($cpf)";; esac
  touch "$d/.complete"
  log "Cassandra $CASS_VERSION fetched ($(elapsed "$t0")s, $(tr ':' '\n' <"$cpf" | wc -l) jars)"
}

PROBE_DIR=""
ensure_probe() { # compiles CqlProbe.java once per content hash; PROBE_DIR empty if impossible
  local src="$HERE/CqlProbe.java" h javac
  h=$(sha256sum "$src" | cut -c1-16)
  local d="$CACHE/cqlprobe/$h"
  if [ ! -f "$d/CqlProbe.class" ]; then
    javac="$(dirname "$JAVA")/javac"
    if [ ! -x "$javac" ]; then
      log "WARNING: no javac next to $JAVA; readiness check falls back to the CQL port only"
      return 0
    fi
    mkdir -p "$d.tmp"
    "$javac" -nowarn -d "$d.tmp" "$src" >&2 || die "could not compile $src"
    rm -rf "$d"; mv "$d.tmp" "$d"
  fi
  PROBE_DIR=$d
}

cql_probe() { # PORT [STATEMENTS...]
  local port=$1; shift
  timeout 60 "$JAVA" -XX:TieredStopAtLevel=1 -Xmx64m -cp "$PROBE_DIR" CqlProbe "$HOST" "$port" "$@"
}

cass_ready() { # PORT -> real CQL query works
  port_open "$1" || return 1
  [ -n "$PROBE_DIR" ] || return 0
  CASS_RELEASE=$(cql_probe "$1" 2>/dev/null) || return 1
}

cass_jvm_opts() { # DIR
  local dir=$1 jamm
  jamm=$(tr ':' '\n' <<<"$CASS_CP" | grep -m1 '/jamm-[0-9.]*\.jar$' || true)
  CASS_OPTS=(
    -Xms"$CASS_XMS" -Xmx"$CASS_XMX" -Xss512k
    -XX:+UseG1GC -XX:+ParallelRefProcEnabled -XX:MaxGCPauseMillis=300
    -XX:+PerfDisableSharedMem -XX:+ExitOnOutOfMemoryError -XX:-HeapDumpOnOutOfMemoryError
    -Djava.net.preferIPv4Stack=true
    # conf/jvm17-server.options (JPMS)
    -Djdk.attach.allowAttachSelf=true
    --add-exports java.base/jdk.internal.misc=ALL-UNNAMED
    --add-exports java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED
    --add-exports java.rmi/sun.rmi.registry=ALL-UNNAMED
    --add-exports java.rmi/sun.rmi.server=ALL-UNNAMED
    --add-exports java.sql/java.sql=ALL-UNNAMED
    --add-exports java.base/java.lang.ref=ALL-UNNAMED
    --add-exports jdk.unsupported/sun.misc=ALL-UNNAMED
    --add-exports jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED
    --add-exports jdk.attach/sun.tools.attach=ALL-UNNAMED
    --add-opens java.base/java.lang.module=ALL-UNNAMED
    --add-opens java.base/jdk.internal.loader=ALL-UNNAMED
    --add-opens java.base/jdk.internal.ref=ALL-UNNAMED
    --add-opens java.base/jdk.internal.reflect=ALL-UNNAMED
    --add-opens java.base/jdk.internal.math=ALL-UNNAMED
    --add-opens java.base/jdk.internal.module=ALL-UNNAMED
    --add-opens java.base/jdk.internal.util.jar=ALL-UNNAMED
    --add-opens jdk.management/com.sun.management.internal=ALL-UNNAMED
    --add-opens java.base/sun.nio.ch=ALL-UNNAMED
    --add-opens java.base/java.io=ALL-UNNAMED
    --add-opens java.base/java.lang.reflect=ALL-UNNAMED
    --add-opens jdk.compiler/com.sun.tools.javac=ALL-UNNAMED
    --add-opens java.base/java.lang=ALL-UNNAMED
    --add-opens java.base/java.util=ALL-UNNAMED
    -Dio.netty.tryReflectionSetAccessible=true
    -Dio.netty.allocator.useCacheForAllThreads=true
    -Dio.netty.allocator.maxOrder=11
    # where and how
    -Dcassandra.config="file://$dir/cassandra.yaml"
    -Dcassandra.storagedir="$dir"
    -Dcassandra.logdir="$dir/logs"
    -Dcassandra.triggers_dir="$dir/triggers"
    -Dlogback.configurationFile="file://$dir/logback.xml"
    -Dcassandra-foreground=yes
    # fast single-node start
    -Dcassandra.skip_wait_for_gossip_to_settle=0
    -Dcassandra.ring_delay_ms=0
    -Dcassandra.load_ring_state=false
    -Dcassandra.superuser_setup_delay_ms=0
    -Dcassandra.unsafesystem=true
    -Dcassandra.memtable.row_overhead_size=180
    # fast shutdown: no 2 s gossip announce, no messaging quiesce wait
    -Dcassandra.shutdown_announce_in_ms=0
    -Dcassandra.test.messagingService.nonGracefulShutdown=true
  )
  [ -n "$jamm" ] && CASS_OPTS+=("-javaagent:$jamm")
  if [ -n "$CASS_JMX_PORT" ]; then
    CASS_OPTS+=("-Dcassandra.jmx.local.port=$CASS_JMX_PORT" -Djava.rmi.server.hostname="$HOST")
  fi
  return 0
}

render() { # TEMPLATE OUT KEY=VAL...
  local tpl=$1 outf=$2 expr=() kv; shift 2
  for kv in "$@"; do expr+=(-e "s|@${kv%%=*}@|${kv#*=}|g"); done
  sed "${expr[@]}" "$tpl" >"$outf"
}

# Cassandra mlockall()s the JVM at startup. As root (CI) that succeeds and pins
# every mapped page (~+300 MiB RSS). Drop CAP_IPC_LOCK and keep a small
# RLIMIT_MEMLOCK so it only logs a warning, as for an ordinary user: sets
# NO_MLOCK to the command prefix that does so (empty with CASS_MLOCK=1).
no_mlock_prefix() {
  NO_MLOCK=()
  [ "$CASS_MLOCK" != 1 ] || return 0
  NO_MLOCK=(bash -c 'ulimit -S -l 64 2>/dev/null || true; exec "$@"' no-mlock)
  if [ "$(id -u)" -eq 0 ] && command -v setpriv >/dev/null 2>&1; then
    NO_MLOCK+=(setpriv --bounding-set=-ipc_lock --)
  fi
}

up_cassandra() {
  local dir="$STATE/cassandra" port pid
  port=$(cat "$dir/port" 2>/dev/null || echo "$CQL_PORT")
  if pid=$(pid_of "$dir" cassandra); then
    ensure_java; ensure_probe
    if cass_ready "$port"; then
      log "cassandra already running on $HOST:$port (pid $pid)"
      return 0
    fi
    log "cassandra (pid $pid) is running but not ready yet; waiting"
    cass_wait "$dir" "$port" "$(now)"
    return 0
  fi
  ensure_java
  ensure_cassandra_dist
  ensure_probe
  port=$CQL_PORT
  require_free_port "$port" IMDEDUP_CQL_PORT
  require_free_port "$CASS_STORAGE_PORT" IMDEDUP_CASSANDRA_STORAGE_PORT
  [ -z "$CASS_JMX_PORT" ] || require_free_port "$CASS_JMX_PORT" IMDEDUP_CASSANDRA_JMX_PORT
  if [ "$CASS_KEEP_DATA" = 1 ]; then
    rm -rf "$dir/logs"
  else
    rm -rf "$dir"
  fi
  mkdir -p "$dir"/{data,commitlog,saved_caches,hints,cdc_raw,logs,triggers}
  echo "$port" >"$dir/port"
  render "$HERE/cassandra.yaml.in" "$dir/cassandra.yaml" DIR="$dir" LISTEN="$HOST" \
    STORAGE_PORT="$CASS_STORAGE_PORT" CQL_PORT="$port" TOKEN=0 SEEDS="$HOST:$CASS_STORAGE_PORT"
  render "$HERE/logback.xml.in" "$dir/logback.xml" LOGDIR="$dir/logs"
  cass_jvm_opts "$dir"
  no_mlock_prefix
  log "starting cassandra $CASS_VERSION (java $JAVA, heap $CASS_XMS..$CASS_XMX)"
  local t0; t0=$(now)
  start_bg "$dir" "$dir/logs/stdout.log" "${NO_MLOCK[@]}" "$JAVA" "${CASS_OPTS[@]}" \
    -cp "$CASS_CP" org.apache.cassandra.service.CassandraDaemon
  cass_wait "$dir" "$port" "$t0"
}

cass_wait() { # DIR PORT T0
  local dir=$1 port=$2 t0=$3 deadline=$((SECONDS + START_TIMEOUT))
  CASS_RELEASE=""
  while :; do
    if ! pid_of "$dir" cassandra >/dev/null; then
      log "cassandra exited during startup; last log lines:"
      tail -n 25 "$dir/logs/system.log" >&2 2>/dev/null || true
      tail -n 10 "$dir/logs/stdout.log" >&2 2>/dev/null || true
      die "cassandra failed to start (logs: $dir/logs/system.log, $dir/logs/stdout.log)"
    fi
    cass_ready "$port" && break
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "cassandra not answering CQL after ${START_TIMEOUT}s; last log lines:"
      tail -n 25 "$dir/logs/system.log" >&2 2>/dev/null || true
      local pid
      if pid=$(pid_of "$dir" cassandra); then stop_pid "$pid" cassandra 10; fi
      die "cassandra not answering CQL on $HOST:$port after ${START_TIMEOUT}s, stopped it (logs: $dir/logs/system.log; raise IMDEDUP_START_TIMEOUT if the machine is just slow)"
    fi
    sleep 0.5
  done
  log "cassandra ${CASS_RELEASE:-?} ready on $HOST:$port (CQL query ok, startup $(elapsed "$t0")s)"
}

# The opt-in three-node cluster (RF 3 keyspaces, LOCAL_QUORUM writes,
# LOCAL_SERIAL LWTs, as users run ScyllaDB). Nodes that are running are left
# alone; a stopped node of a cluster with a node still up restarts on its
# data (a node coming back); with none up, the cluster starts afresh.
cluster_dir() { echo "$STATE/cassandra-cluster/node$(($1 + 1))"; }

up_cassandra_cluster() {
  ensure_java
  ensure_cassandra_dist
  ensure_probe
  local i dir any_up=0 t0 starting=()
  for i in 0 1 2; do pid_of "$(cluster_dir "$i")" cassandra >/dev/null && any_up=1; done
  if [ "$any_up" = 0 ]; then rm -rf "$STATE/cassandra-cluster"; fi
  no_mlock_prefix
  t0=$(now)
  for i in 0 1 2; do
    local HOST=${CLUSTER_HOSTS[$i]}
    dir=$(cluster_dir "$i")
    pid_of "$dir" cassandra >/dev/null && continue
    require_free_port "$CLUSTER_CQL_PORT" IMDEDUP_CLUSTER_CQL_PORT
    require_free_port "$CLUSTER_STORAGE_PORT" IMDEDUP_CLUSTER_STORAGE_PORT
    mkdir -p "$dir"/{data,commitlog,saved_caches,hints,cdc_raw,logs,triggers}
    echo "$CLUSTER_CQL_PORT" >"$dir/port"
    render "$HERE/cassandra.yaml.in" "$dir/cassandra.yaml" DIR="$dir" LISTEN="$HOST" \
      STORAGE_PORT="$CLUSTER_STORAGE_PORT" CQL_PORT="$CLUSTER_CQL_PORT" \
      TOKEN="${CLUSTER_TOKENS[$i]}" SEEDS="${CLUSTER_HOSTS[0]}:$CLUSTER_STORAGE_PORT"
    render "$HERE/logback.xml.in" "$dir/logback.xml" LOGDIR="$dir/logs"
    # Local JMX binds 127.0.0.1 whatever the node's address: a port each.
    local CASS_XMX=$CLUSTER_XMX CASS_JMX_PORT=$((CLUSTER_JMX_PORT + i))
    require_free_port "$CASS_JMX_PORT" IMDEDUP_CLUSTER_JMX_PORT
    cass_jvm_opts "$dir"
    # A node that comes back first asks the seed about the ring (a shadow
    # round): give it the time the single node's fast start takes away.
    CASS_OPTS+=(-Dcassandra.ring_delay_ms=10000)
    log "starting cassandra cluster node $((i + 1)) on $HOST (heap $CASS_XMS..$CASS_XMX)"
    start_bg "$dir" "$dir/logs/stdout.log" "${NO_MLOCK[@]}" "$JAVA" "${CASS_OPTS[@]}" \
      -cp "$CASS_CP" org.apache.cassandra.service.CassandraDaemon
    starting+=("$i")
    # The others gossip with the seed (node 1) when they start: it goes first.
    if [ "$i" = 0 ]; then cass_wait "$dir" "$CLUSTER_CQL_PORT" "$t0"; fi
  done
  for i in "${starting[@]}"; do
    [ "$i" = 0 ] && continue
    local HOST=${CLUSTER_HOSTS[$i]}
    cass_wait "$(cluster_dir "$i")" "$CLUSTER_CQL_PORT" "$t0"
  done
  # Every node knows the two others before anyone uses the cluster.
  local deadline=$((SECONDS + START_TIMEOUT)) peers
  for i in 0 1 2; do
    local HOST=${CLUSTER_HOSTS[$i]}
    while :; do
      peers=$(cql_probe "$CLUSTER_CQL_PORT" "SELECT peer FROM system.peers" 2>/dev/null \
        | sed -n 's/^(\([0-9]*\) rows)$/\1/p' || true)
      [ "${peers:-0}" -ge 2 ] && break
      [ "$SECONDS" -lt "$deadline" ] || die "cassandra cluster node $((i + 1)) sees $peers peers after ${START_TIMEOUT}s (logs: $(cluster_dir "$i")/logs/system.log)"
      sleep 1
    done
  done
  log "cassandra cluster ready: ${CLUSTER_HOSTS[*]} port $CLUSTER_CQL_PORT ($(elapsed "$t0")s)"
}

# ---------------------------------------------------------------- env / status / down

print_env() {
  local port p i list=""
  if port=$(cat "$STATE/redis/port" 2>/dev/null) && pid_of "$STATE/redis" redis "$port" >/dev/null; then
    echo "export IMDEDUP_TEST_REDIS_URL=redis://$HOST:$port"
  fi
  if port=$(cat "$STATE/cassandra/port" 2>/dev/null) && pid_of "$STATE/cassandra" cassandra >/dev/null; then
    echo "export IMDEDUP_TEST_SCYLLA=$HOST:$port"
  fi
  list=""
  if [ -d "$STATE/cassandra-cluster" ]; then
    for i in 0 1 2; do list="${list:+$list,}${CLUSTER_HOSTS[$i]}:$CLUSTER_CQL_PORT"; done
    echo "export IMDEDUP_TEST_SCYLLA_CLUSTER=$list"
    echo "export IMDEDUP_CASSANDRA_CLUSTER_DIR=$STATE/cassandra-cluster"
    list=""
  fi
  if [ -s "$STATE/redis-cluster/ports" ]; then
    for p in $(cat "$STATE/redis-cluster/ports"); do
      pid_of "$STATE/redis-cluster/$p" redis "$p" >/dev/null || { list=""; break; }
      list="${list:+$list,}redis://$HOST:$p"
    done
    [ -z "$list" ] || echo "export IMDEDUP_TEST_REDIS_CLUSTER=$list"
  fi
  return 0
}

cmd_status() {
  local bad=0 port pid p
  port=$(cat "$STATE/redis/port" 2>/dev/null || echo "$REDIS_PORT")
  if pid=$(pid_of "$STATE/redis" redis "$port"); then
    if command -v redis-cli >/dev/null 2>&1 && redis_ping "$port"; then
      echo "redis          up        pid $pid  redis://$HOST:$port"
    else echo "redis          UNHEALTHY pid $pid  redis://$HOST:$port  (log: $STATE/redis/redis.log)"; bad=1; fi
  elif [ -s "$STATE/redis/pid" ]; then echo "redis          DEAD      (log: $STATE/redis/redis.log)"; bad=1
  else echo "redis          down"; fi

  if [ -s "$STATE/redis-cluster/ports" ]; then
    for p in $(cat "$STATE/redis-cluster/ports"); do
      if pid=$(pid_of "$STATE/redis-cluster/$p" redis "$p"); then
        local st; st=$(rcli -p "$p" cluster info 2>/dev/null | tr -d '\r' | sed -n 's/^cluster_state://p')
        [ "$st" = ok ] || bad=1
        echo "redis-cluster  ${st:-?}        pid $pid  redis://$HOST:$p"
      else echo "redis-cluster  DOWN      redis://$HOST:$p"; bad=1; fi
    done
  else echo "redis-cluster  down"; fi

  port=$(cat "$STATE/cassandra/port" 2>/dev/null || echo "$CQL_PORT")
  if pid=$(pid_of "$STATE/cassandra" cassandra); then
    local rss; rss=$(awk '/^VmRSS/ { printf "%d MiB", $2/1024 }' "/proc/$pid/status" 2>/dev/null || true)
    ensure_java; ensure_probe
    if cass_ready "$port"; then
      echo "cassandra      up        pid $pid  $HOST:$port  (${CASS_RELEASE:-?}, rss $rss)"
    else echo "cassandra      STARTING/UNHEALTHY pid $pid  $HOST:$port  (log: $STATE/cassandra/logs/system.log)"; bad=1; fi
  elif [ -s "$STATE/cassandra/pid" ]; then echo "cassandra      DEAD      (log: $STATE/cassandra/logs/system.log)"; bad=1
  else echo "cassandra      down"; fi

  if [ -d "$STATE/cassandra-cluster" ]; then
    for i in 0 1 2; do
      if pid=$(pid_of "$(cluster_dir "$i")" cassandra); then
        echo "cassandra-cluster node$((i + 1))  pid $pid  ${CLUSTER_HOSTS[$i]}:$CLUSTER_CQL_PORT"
      else echo "cassandra-cluster node$((i + 1))  DOWN  ${CLUSTER_HOSTS[$i]}:$CLUSTER_CQL_PORT"; bad=1; fi
    done
  fi
  return "$bad"
}

cmd_down() {
  local purge=${1:-} dir pid p i
  [ -d "$STATE" ] || { log "nothing to stop ($STATE does not exist)"; return 0; }
  lock
  local pids=() names=() dirs=()
  if [ -d "$STATE/cassandra" ] && pid=$(pid_of "$STATE/cassandra" cassandra); then
    pids+=("$pid"); names+=(cassandra); dirs+=("$STATE/cassandra")
  fi
  for i in 0 1 2; do
    dir=$(cluster_dir "$i")
    if [ -d "$dir" ] && pid=$(pid_of "$dir" cassandra); then
      pids+=("$pid"); names+=("cassandra-cluster:node$((i + 1))"); dirs+=("$dir")
    fi
  done
  if p=$(cat "$STATE/redis/port" 2>/dev/null) && pid=$(pid_of "$STATE/redis" redis "$p"); then
    pids+=("$pid"); names+=(redis); dirs+=("$STATE/redis")
  fi
  for dir in "$STATE"/redis-cluster/*/; do
    [ -f "$dir/port" ] || continue
    dir=${dir%/}; p=$(cat "$dir/port")
    if pid=$(pid_of "$dir" redis "$p"); then pids+=("$pid"); names+=("redis-cluster:$p"); dirs+=("$dir"); fi
  done
  # Signal everything first, then wait, so shutdowns overlap.
  local i
  for i in "${!pids[@]}"; do kill -TERM "${pids[$i]}" 2>/dev/null || true; done
  for i in "${!pids[@]}"; do stop_pid "${pids[$i]}" "${names[$i]}" "$STOP_TIMEOUT" nosignal; done
  rm -f "$STATE"/cassandra/pid "$STATE"/redis/pid "$STATE"/redis-cluster/*/pid
  rm -rf "$STATE/redis-cluster"   # nodes.conf must not survive: the next up creates a new cluster
  rm -rf "$STATE/cassandra-cluster"
  [ "${#pids[@]}" -gt 0 ] || log "nothing was running"
  if [ "$purge" = --purge ]; then
    rm -rf "$STATE"
    log "removed $STATE"
  fi
}

cmd_up() {
  local want_redis=0 want_cass=0 want_cluster=0 want_cass_cluster=0 a
  for a in "$@"; do
    case "$a" in
      --redis) want_redis=1 ;;
      --cassandra|--scylla|--cql) want_cass=1 ;;
      --redis-cluster) want_cluster=1 ;;
      --cassandra-cluster) want_cass_cluster=1 ;;
      *) die "unknown option for up: $a" ;;
    esac
  done
  if [ $((want_redis + want_cass + want_cluster + want_cass_cluster)) -eq 0 ]; then want_redis=1; want_cass=1; fi
  lock
  mkdir -p "$CACHE"
  local t0; t0=$(now)
  [ "$want_redis" = 0 ] || up_redis
  [ "$want_cluster" = 0 ] || up_redis_cluster
  [ "$want_cass" = 0 ] || up_cassandra
  [ "$want_cass_cluster" = 0 ] || up_cassandra_cluster
  log "up done in $(elapsed "$t0")s"
  print_env
}

cmd_cql() {
  [ "$#" -gt 0 ] || die "usage: $0 cql 'STATEMENT' ['STATEMENT' ...]"
  local port; port=$(cat "$STATE/cassandra/port" 2>/dev/null || echo "$CQL_PORT")
  ensure_java; ensure_probe
  [ -n "$PROBE_DIR" ] || die "no javac available to build the CQL client"
  cql_probe "$port" "$@"
}

# Every running node of the cluster flushes its memtables (the schema's
# too) to sstables. A node SIGKILLed with a schema change only in its commit
# log replays it into system_schema on restart but not into the schema it
# serves (Cassandra 5.0.9: "keyspace … does not exist" for minutes), so the
# fault scenarios flush the keyspaces they make before killing nodes.
cmd_flush_cluster() {
  ensure_java
  ensure_cassandra_dist
  local i dir n=0
  for i in 0 1 2; do
    dir=$(cluster_dir "$i")
    pid_of "$dir" cassandra >/dev/null || continue
    "$JAVA" -Xmx128m -XX:TieredStopAtLevel=1 --add-exports java.base/sun.nio.ch=ALL-UNNAMED \
      --add-opens java.base/sun.nio.ch=ALL-UNNAMED --add-exports java.base/jdk.internal.ref=ALL-UNNAMED \
      -cp "$CASS_CP" org.apache.cassandra.tools.NodeTool \
      -h 127.0.0.1 -p $((CLUSTER_JMX_PORT + i)) flush >/dev/null \
      || die "nodetool flush failed on cluster node $((i + 1)) (JMX 127.0.0.1:$((CLUSTER_JMX_PORT + i)))"
    n=$((n + 1))
  done
  [ "$n" -gt 0 ] || die "no node of the cassandra cluster is running"
  log "cassandra cluster: $n nodes flushed"
}

main() {
  [ "$#" -ge 1 ] || usage
  local cmd=$1; shift
  case "$cmd" in
    up) cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    status) cmd_status ;;
    env) print_env ;;
    cql) cmd_cql "$@" ;;
    flush-cluster) cmd_flush_cluster ;;
    -h|--help|help) usage 0 ;;
    *) log "unknown command: $cmd"; usage ;;
  esac
}

main "$@"
