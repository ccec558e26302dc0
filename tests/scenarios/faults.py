"""Fault scenarios under load on Redis + Cassandra, each audited with followers.

Run by tests/scenarios/faults.sh (which starts the services and builds the
binaries); see that script for the overview. Python 3.11 standard library only.

Every scenario starts its own cluster on loopback, one process per service
(storage, ingest shards writing to Cassandra themselves, a gateway), talking
mutual TLS with certificates from `imdedup certs`, in a
keyspace and Redis key prefix of its own, drives `imdedup-load steady` through
the gateway with followers, injects its fault while the load runs, and prints
one line: messages, lost, repeats, missed by followers, reordered (delivered
out of seq order + stored out of send order), seq order violations, and the
phones' failed sends (a failure is not a loss: the phone shows it and resends
later). The exit status is 1 when any of the must-be-zero counts is not 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from localprocs import HarnessError, driver_report, Processes, free_port, http_get, wait_for

TOKEN_SECRET = "fault-scenarios-secret-0123456789"
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"faults: [{time.monotonic() - T0:5.1f}s] {msg}", file=sys.stderr, flush=True)


class Cluster:
    """storage + ingest shards + gateway, restartable one by one."""

    def __init__(self, args, procs: Processes, keyspace: str, shards: int, env: dict):
        self.args, self.procs, self.keyspace, self.env = args, procs, keyspace, env
        self.ports: dict[str, tuple[int, int]] = {}
        self.running: dict[str, subprocess.Popen] = {}
        self.generation: dict[str, int] = {}
        self.names = [f"ingest-{i}" for i in range(shards)]
        self.notes: list[str] = []
        # The gateway's groups file; the load driver adds its run's groups.
        self.groups = Path(tempfile.gettempdir()) / f"imdedup-faults-{keyspace}-groups.json"
        self.groups.write_text("{}")
        # Mutual TLS between the services, as deployed: a throwaway CA.
        self.tls = procs.logdir / f"tls-{keyspace}"
        subprocess.run([args.imdedup, "certs", "--out", str(self.tls)], check=True,
                       stdout=subprocess.DEVNULL)

    def tls_flags(self, service: str) -> list[str]:
        d = self.tls / service
        return ["--tls-cert", str(d / "tls.crt"), "--tls-key", str(d / "tls.key"),
                "--tls-ca", str(d / "ca.crt")]

    def port(self, name: str) -> tuple[int, int]:
        if name not in self.ports:
            self.ports[name] = (free_port(), free_port())
        return self.ports[name]

    def shard_map(self, names: list[str]) -> str:
        return ",".join(f"{n}=https://127.0.0.1:{self.port(n)[0]}" for n in names)

    def rf(self) -> str:
        return "3" if getattr(self.args, "cassandra_cluster", False) else "1"

    def scylla(self) -> list[str]:
        return ["--scylla", self.args.scylla, "--scylla-keyspace", self.keyspace,
                "--scylla-replication-factor", self.rf(), "--scylla-migrate", "false",
                "--scylla-pending-fence", "12s"]

    def argv(self, name: str, names: list[str]) -> list[str]:
        grpc, admin = self.port(name)
        common = [f"--listen=127.0.0.1:{grpc}", f"--admin-listen=127.0.0.1:{admin}", "--grace=3s"]
        storage = f"https://127.0.0.1:{self.port('storage')[0]}"
        if name == "storage":
            return [self.args.imdedup, "storage", *common, *self.tls_flags("storage"),
                    *self.scylla()]
        if name == "gateway":
            return [self.args.imdedup, "gateway", *common, *self.tls_flags("gateway"),
                    "--shards", self.shard_map(names),
                    "--storage", storage, "--groups-file", str(self.groups)]
        return [self.args.imdedup, "ingest", *common, *self.tls_flags("ingest"),
                "--shard-name", name,
                "--shards", self.shard_map(names), "--storage", storage,
                "--redis", self.args.redis, "--redis-key-prefix", f"{self.keyspace}:",
                *self.scylla()]

    def start(self, name: str, names: list[str], env: dict | None = None) -> None:
        generation = self.generation.get(name, 0) + 1
        self.generation[name] = generation
        proc = self.procs.start(f"{self.keyspace}-{name}-{generation}", self.argv(name, names),
                                {"IMDEDUP_TOKEN_SECRET": TOKEN_SECRET, **self.env, **(env or {})})
        self.running[name] = proc
        admin = self.port(name)[1]
        wait_for(f"{name} /readyz", lambda: http_get(f"http://127.0.0.1:{admin}/readyz")[0] == 200,
                 60, self.procs)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.running.pop(name)
        proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with self.procs.lock:
            self.procs.children = [(n, p) for n, p in self.procs.children if p is not proc]

    def restart(self, name: str, names: list[str], sig: int = signal.SIGTERM, down: float = 0.0) -> None:
        self.stop(name, sig)
        time.sleep(down)
        self.start(name, names)
        self.notes.append(f"{'killed' if sig == signal.SIGKILL else 'restarted'} {name}")

    def migrate(self) -> None:
        subprocess.run([self.args.imdedup, "migrate", "--scylla", self.args.scylla,
                        "--scylla-keyspace", self.keyspace, "--scylla-replication-factor", self.rf()],
                       check=True, stdout=subprocess.DEVNULL)

    def up(self, ingest_env: dict | None = None) -> None:
        """The services, on a keyspace already migrated."""
        self.start("storage", self.names)
        for name in self.names:
            self.start(name, self.names, ingest_env)
        self.start("gateway", self.names)

    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port('gateway')[0]}/v1/ws"


def load(args, cluster: Cluster, out: Path, fault) -> dict:
    """Run the load; `fault` runs in a thread once the load is under way."""
    argv = [args.load, "steady", "--url", cluster.url(), "--groups-file", str(cluster.groups),
            "--rate", str(args.rate),
            "--duration", f"{args.duration}s", "--users", "60", "--loss-send", "0.01",
            "--loss-ack", "0.01", "--time-scale", "0.5", "--quiet", "--json", str(out)]
    log_file = out.with_suffix(".log")
    driver = subprocess.Popen(argv, stdout=open(log_file, "wb"), stderr=subprocess.STDOUT,
                              env={"IMDEDUP_TOKEN_SECRET": TOKEN_SECRET, "PATH": "/usr/bin:/bin"})
    failure: list[BaseException] = []

    def body():
        try:
            fault()
        except BaseException as e:  # reported after the load ends
            failure.append(e)

    thread = threading.Thread(target=body, daemon=True)
    time.sleep(2)
    thread.start()
    try:
        driver.wait(timeout=args.duration + 240)
    except subprocess.TimeoutExpired:
        driver.kill()
        raise HarnessError(f"the load driver did not finish; log: {log_file}")
    thread.join(timeout=120)
    if failure:
        raise HarnessError(f"the fault step failed: {failure[0]}")
    return driver_report(out, log_file, driver.returncode)


def scenarios(cluster: Cluster, duration: float):
    """name -> (ingest env, fault); the fault sees the running cluster."""
    two, three = cluster.names[:2], cluster.names[:2] + ["ingest-2"]

    def at(seconds: float):
        time.sleep(seconds)

    def sigkill():
        at(duration * 0.3)
        cluster.restart("ingest-1", two, signal.SIGKILL, down=1.0)

    def rolling():
        at(duration * 0.2)
        for name in ["storage", *two, "gateway"]:
            cluster.restart(name, two)
            at(1.0)

    def reshard():
        at(duration * 0.15)
        # 2 -> 3, in the order a Helm upgrade rolls it: the new shard starts,
        # the gateways and the old shards roll onto the new map.
        cluster.start("ingest-2", three)
        for name in ["gateway", "ingest-1", "ingest-0"]:
            cluster.restart(name, three)
        cluster.notes.append("shards 2 -> 3")
        at(duration * 0.2)
        # 3 -> 2: the gateway routes by the old map again, the third shard
        # leaves (its conversations free at once), the others roll back.
        cluster.restart("gateway", two)
        cluster.stop("ingest-2")
        for name in ["ingest-1", "ingest-0"]:
            cluster.restart(name, two)
        cluster.notes.append("shards 3 -> 2")

    if getattr(cluster.args, "cassandra_cluster", False):
        return database_faults(cluster, duration)
    if getattr(cluster.args, "redis_cluster", False):
        return redis_failover(cluster, duration)
    return {
        "history-write-failing": ({"IMDEDUP_FAULT_COMMIT_FAILURES": "0.05"}, lambda: None),
        "ingest-sigkill": ({}, sigkill),
        "rolling-restart": ({}, rolling),
        "shards-2-3-2": ({}, reshard),
    }


def node_pid(n: int) -> int:
    """The pid of node `n` (1-3) of services.sh's Cassandra cluster."""
    state = os.environ["IMDEDUP_CASSANDRA_CLUSTER_DIR"]
    return int(Path(state, f"node{n}", "pid").read_text().strip())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def flush_schema() -> None:
    """Every node writes the keyspaces just made to its sstables. Cassandra
    5.0.9, SIGKILLed with a schema change still only in its commit log,
    replays it into system_schema on restart but not into the schema it
    serves: it lists the keyspace and answers "keyspace … does not exist"
    to queries on it (seen for minutes, until the run ended). A deployed
    keyspace has long been flushed; the scenarios' fresh ones are made so
    here. (Restarting each node instead, as this did before, left three
    cold JVMs compiling on the shared cores for the first scenario.)"""
    here = Path(__file__).resolve().parent
    subprocess.run([str(here.parent / "services" / "services.sh"), "flush-cluster"], check=True,
                   stdout=subprocess.DEVNULL)
    log("keyspaces flushed on every node")


WARM_UP_SECONDS = 10


def warm_up(args, procs: Processes, keyspace: str, tmp: Path) -> None:
    """The scenario's load for a few seconds on a keyspace of its own, not
    audited: a node (re)started by the harness or an earlier scenario
    compiles its hot paths under the first load it serves (its JIT), and on
    two cores shared by three nodes, the services and the driver that
    starves everything for tens of seconds. Each scenario's own faults,
    restarts included, still happen under its audited load."""
    cluster = Cluster(args, procs, keyspace, 2, {})
    cluster.up({})
    short = argparse.Namespace(**{**vars(args), "duration": WARM_UP_SECONDS})
    report = load(short, cluster, tmp / "warm-up.json", lambda: None)
    latency, failed = report["ack_latency"], report["audit"]["failed"]
    log(f"warm-up: {report['achieved_rate']:.0f}/s, p99 ACK {latency['p99_ms']:.0f} ms, "
        f"{failed} failed on the phone")


def restart_nodes() -> None:
    """services.sh brings the stopped nodes back, on their data."""
    here = Path(__file__).resolve().parent
    subprocess.run([str(here.parent / "services" / "services.sh"), "up", "--cassandra-cluster"], check=True,
                   stdout=subprocess.DEVNULL)


def database_faults(cluster: Cluster, duration: float):
    """On the three-node cluster (RF 3, LOCAL_QUORUM, LOCAL_SERIAL): nodes
    killed, paused, and a quorum lost and regained, while the load runs."""

    def at(seconds: float):
        time.sleep(seconds)

    def kill(n: int):
        os.kill(node_pid(n), signal.SIGKILL)
        cluster.notes.append(f"killed node{n}")

    def node_sigkill():
        at(duration * 0.3)
        kill(3)
        at(duration * 0.4)
        restart_nodes()
        cluster.notes.append("node3 back")

    def node_pause():
        at(duration * 0.3)
        pid = node_pid(2)
        os.kill(pid, signal.SIGSTOP)
        cluster.notes.append("paused node2 10 s")
        at(10)
        os.kill(pid, signal.SIGCONT)

    def no_quorum():
        at(duration * 0.3)
        kill(2)
        kill(3)
        killed = time.monotonic()
        at(6)
        restart_nodes()
        cluster.notes.append(f"node2, node3 back {time.monotonic() - killed:.0f} s after")

    def node_restart_resharding():
        # A node restarted (SIGTERM, back on its data) while a third shard
        # joins and every service rolls onto the new map, as a database
        # upgrade and a scale-out of the ingests might overlap.
        two, three = cluster.names[:2], cluster.names[:2] + ["ingest-2"]
        at(duration * 0.15)
        pid = node_pid(3)
        os.kill(pid, signal.SIGTERM)
        wait_for("node3 to stop", lambda: not alive(pid), 60, cluster.procs)
        cluster.notes.append("stopped node3")
        cluster.start("ingest-2", three)
        for name in ["gateway", "ingest-1", "ingest-0"]:
            cluster.restart(name, three)
        cluster.notes.append(f"shards {len(two)} -> 3")
        restart_nodes()
        cluster.notes.append("node3 back")

    return {
        # The same load with no fault: the baseline the others are read
        # against.
        "no-fault": ({}, lambda: None),
        "node-sigkill": ({}, node_sigkill),
        "node-pause": ({}, node_pause),
        "two-nodes-down": ({}, no_quorum),
        "node-restart-2-3-shards": ({}, node_restart_resharding),
    }


def redis_cli(port: int, *command: str) -> str:
    return subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *command],
                          capture_output=True, text=True, timeout=10).stdout


def redis_failover(cluster: Cluster, duration: float):
    """On services.sh's Redis Cluster (three masters, a replica each): a
    master SIGKILLed while the load runs; its replica takes over."""
    ports = [int(url.rsplit(":", 1)[1]) for url in cluster.args.redis.split(",")]

    def masters(port: int) -> list[int]:
        """The ports of the masters serving slots, as `port` sees them
        (CLUSTER NODES: id, host:port@bus, flags, master, …, slots)."""
        found = []
        for line in redis_cli(port, "cluster", "nodes").splitlines():
            fields = line.split()
            if len(fields) > 8 and "master" in fields[2] and "fail" not in fields[2]:
                found.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        return found

    def kill_master():
        time.sleep(duration * 0.3)
        victim = masters(ports[0])[0]
        pid = int(redis_cli(victim, "info", "server").split("process_id:")[1].split()[0])
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        cluster.notes.append(f"killed the Redis master on :{victim}")
        survivor = next(p for p in ports if p != victim)

        def promoted() -> bool:
            serving = masters(survivor)
            return ("cluster_state:ok" in redis_cli(survivor, "cluster", "info")
                    and len(serving) == 3 and victim not in serving)
        wait_for("a replica to take over the killed master's slots", promoted, 60, cluster.procs)
        cluster.notes.append(f"its replica took over after {time.monotonic() - killed:.1f} s")

    return {"redis-master-killed": ({}, kill_master)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imdedup", required=True)
    parser.add_argument("--load", required=True)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--scylla", required=True)
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--duration", type=float, default=20)
    parser.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    parser.add_argument("--cassandra-cluster", action="store_true",
                        help="the database faults, on services.sh's three-node cluster")
    parser.add_argument("--redis-cluster", action="store_true",
                        help="a Redis master killed, on services.sh's Redis Cluster "
                             "(--redis lists its nodes)")
    args = parser.parse_args()
    ingest_help = subprocess.run([args.imdedup, "ingest", "--help"], capture_output=True,
                                 text=True, check=True).stdout
    if "--fault-commit-failures" not in ingest_help:
        print(f"faults: {args.imdedup} has no fault injection; build it with "
              "`cargo build -p imdedup --features testing`", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="imdedup-faults-"))
    procs = Processes(tmp)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"{'scenario':<24} {'messages':>8} {'lost':>5} {'repeats':>7} {'missed':>6} "
          f"{'reordered':>9} {'seq-viol':>8} {'failed':>6}  what happened")
    ok = True
    try:
        names = [name for name in scenarios(Cluster(args, procs, "x", 2, {}), args.duration)
                 if not args.only or name in args.only]
        keyspaces = {name: f"f{uuid.uuid4().hex[:10]}" for name in names}
        warm = f"w{uuid.uuid4().hex[:10]}" if args.cassandra_cluster else None
        for keyspace in [*keyspaces.values(), *([warm] if warm else [])]:
            Cluster(args, procs, keyspace, 2, {}).migrate()
        if args.cassandra_cluster:
            flush_schema()
        for name in names:
            keyspace = keyspaces[name]
            if warm:
                warm_up(args, procs, warm, tmp)
                procs.stop_all()
                procs = Processes(tmp)
            cluster = Cluster(args, procs, keyspace, 2, {"RUST_LOG": "info"})
            ingest_env, fault = scenarios(cluster, args.duration)[name]
            log(f"{name}: starting a cluster in keyspace {keyspace}")
            cluster.up(ingest_env)
            report = load(args, cluster, tmp / f"{name}.json", fault)
            a = report["audit"]
            reordered = a["delivered_out_of_order"] + a["stored_out_of_send_order"]
            bad = (a["lost"] + a["repeats"] + a["missed_by_followers"] + reordered
                   + a["seq_order_violations"] + a["ack_mismatches"])
            ok &= bad == 0 and a["delivered_to_followers"] > 0
            what = ", ".join(cluster.notes) or (
                "5% of publishing writes fail" if name == "history-write-failing" else "no fault")
            print(f"{name:<24} {a['messages']:>8} {a['lost']:>5} {a['repeats']:>7} "
                  f"{a['missed_by_followers']:>6} {reordered:>9} {a['seq_order_violations']:>8} "
                  f"{a['failed']:>6}  {what}{'' if bad == 0 else '  FAIL'}", flush=True)
            procs.stop_all()
            procs = Processes(tmp)
    except HarnessError as e:
        print(f"faults: ERROR: {e}", file=sys.stderr)
        ok = False
    finally:
        procs.stop_all()
    log(f"logs in {tmp}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
