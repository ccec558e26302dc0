"""CPU per acknowledged message of each service, side by side with a NATS
JetStream server doing the same number of deduplicated publishes.

Run by bench/cpu-per-message.sh (which builds the binaries); see that
script for the overview. Python 3.11 standard library only.

One cluster on loopback, one process per service (storage on SQLite, two
ingest shards with their in-process windows, a gateway), talking mutual TLS
with certificates from `imdedup certs`. For each offered rate,
`imdedup-load steady --url ... --admin NAME=URL ...` reads every service's
`process_cpu_seconds_total` before and after sending and reports CPU µs per
acknowledged message (and its own). Then `jetstream-bench` publishes the same
number of messages at the same rate to a JetStream stream with a duplicate
window (file storage), 11% of them resends of an earlier `Nats-Msg-Id`, and
the server's CPU is read from /proc/<pid>/stat around the publishes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from localprocs import HarnessError, driver_report, Processes, free_port, http_get, port_open, wait_for

TOKEN_SECRET = "cpu-per-message-secret-0123456789abcdef"
# The CPU-per-message goal: the services' CPU per acknowledged message at
# most this many times JetStream's per deduplicated publish, measured in the
# same run at the same rate (the ratio is the goal; the absolute figures
# depend on the machine and the hour).
GOAL_RATIO = 3.0
IDLE_SECONDS = 10
T0 = time.monotonic()
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"cpu-per-message: [{time.monotonic() - T0:5.1f}s] {msg}", file=sys.stderr, flush=True)


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_switches(pid: int) -> int:
    """Voluntary context switches of every thread of a process (each one a
    thread that went to sleep and was woken again), from /proc/<pid>/task."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:
            pass  # a thread that ended meanwhile
    return total


class Cluster:
    def __init__(self, args, procs: Processes, work: Path):
        self.args, self.procs, self.work = args, procs, work
        self.names = ["ingest-0", "ingest-1"]
        self.ports = {n: (free_port(), free_port()) for n in ["storage", *self.names, "gateway"]}
        self.pids: dict[str, int] = {}
        # A keyspace and Redis prefix of this run's own (real backends).
        self.keyspace = f"cpu{uuid.uuid4().hex[:10]}"
        self.groups = work / "groups.json"
        self.groups.write_text("{}")
        self.tls = work / "tls"
        subprocess.run([args.imdedup, "certs", "--out", str(self.tls)], check=True,
                       stdout=subprocess.DEVNULL)

    def tls_flags(self, service: str) -> list[str]:
        d = self.tls / service
        return ["--tls-cert", str(d / "tls.crt"), "--tls-key", str(d / "tls.key"),
                "--tls-ca", str(d / "ca.crt")]

    def argv(self, name: str) -> list[str]:
        grpc, admin = self.ports[name]
        common = [f"--listen=127.0.0.1:{grpc}", f"--admin-listen=127.0.0.1:{admin}"]
        storage = f"https://127.0.0.1:{self.ports['storage'][0]}"
        shards = ",".join(f"{n}=https://127.0.0.1:{self.ports[n][0]}" for n in self.names)
        if name == "storage":
            if self.args.scylla:
                return [self.args.imdedup, "storage", *common, *self.tls_flags("storage"),
                        *self.scylla()]
            return [self.args.imdedup, "storage", *common, *self.tls_flags("storage"),
                    "--data-dir", str(self.work / "storage"),
                    "--commit-delay", self.args.commit_delay]
        if name == "gateway":
            return [self.args.imdedup, "gateway", *common, *self.tls_flags("gateway"),
                    "--shards", shards, "--storage", storage, "--groups-file", str(self.groups)]
        real = []
        if self.args.scylla:
            real = ["--redis", self.args.redis, "--redis-key-prefix", f"{self.keyspace}:",
                    *self.scylla()]
        return [self.args.imdedup, "ingest", *common, *self.tls_flags("ingest"),
                "--shard-name", name, "--shards", shards, "--storage", storage, *real]

    def scylla(self) -> list[str]:
        return ["--scylla", self.args.scylla, "--scylla-keyspace", self.keyspace,
                "--scylla-replication-factor", "1", "--scylla-migrate", "false"]

    def up(self) -> None:
        if self.args.scylla:
            subprocess.run([self.args.imdedup, "migrate", "--scylla", self.args.scylla,
                            "--scylla-keyspace", self.keyspace, "--scylla-replication-factor", "1"],
                           check=True, stdout=subprocess.DEVNULL)
        for name in ["storage", *self.names, "gateway"]:
            env = {"IMDEDUP_TOKEN_SECRET": TOKEN_SECRET, "RUST_LOG": "warn"}
            if self.args.worker_threads:
                env["TOKIO_WORKER_THREADS"] = str(self.args.worker_threads)
            proc = self.procs.start(name, self.argv(name), env)
            self.pids[name] = proc.pid
            admin = self.ports[name][1]
            wait_for(f"{name} /readyz",
                     lambda: http_get(f"http://127.0.0.1:{admin}/readyz")[0] == 200, 60, self.procs)

    def url(self) -> str:
        return f"ws://127.0.0.1:{self.ports['gateway'][0]}/v1/ws"

    def admin_flags(self) -> list[str]:
        out = []
        for name, (_, admin) in self.ports.items():
            out += ["--admin", f"{name}=http://127.0.0.1:{admin}"]
        return out


def start_profiles(args, cluster: Cluster, rate: int) -> list[tuple[str, subprocess.Popen]]:
    """`perf record` on every service for the sending phase of one rate, with
    DWARF call graphs (the release build keeps no frame pointers)."""
    out = []
    for name in cluster.ports:
        data = args.profile / f"{name}-{rate}.perf.data"
        argv = ["perf", "record", "-F", "499", "--call-graph", "dwarf,16384", "-q", "-o", str(data),
                "-p", str(cluster.pids[name]), "--", "sleep", f"{args.duration:g}"]
        out.append((name, subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)))
    return out


def finish_profiles(args, rate: int, profiles: list[tuple[str, subprocess.Popen]]) -> None:
    """Top self-time symbols (perf report) and, with inferno installed, a
    flame graph per service."""
    for name, perf in profiles:
        perf.wait(timeout=args.duration + 60)
        data = args.profile / f"{name}-{rate}.perf.data"
        report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--stdio", "-g", "none",
                                 "--sort", "dso,symbol", "--percent-limit", "1"],
                                capture_output=True, text=True).stdout
        (args.profile / f"{name}-{rate}.top.txt").write_text(report)
        collapse = shutil.which("inferno-collapse-perf")
        flamegraph = shutil.which("inferno-flamegraph")
        if collapse and flamegraph:
            script = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True)
            folded = subprocess.run([collapse], input=script.stdout, capture_output=True)
            svg = subprocess.run([flamegraph, "--title", f"{name} at {rate} msgs/s"],
                                 input=folded.stdout, capture_output=True)
            (args.profile / f"{name}-{rate}.svg").write_bytes(svg.stdout)
    log(f"{rate}/s: profiles in {args.profile}")


def idle_cpu(cluster: Cluster, seconds: float) -> dict[str, float]:
    """Each service's CPU milliseconds per second while nothing is sent: what
    a quiet cluster burns (timers, heartbeats, metrics)."""
    before = {name: proc_cpu_seconds(pid) for name, pid in cluster.pids.items()}
    time.sleep(seconds)
    return {name: (proc_cpu_seconds(pid) - before[name]) * 1000 / seconds
            for name, pid in cluster.pids.items()}


def drive(args, cluster: Cluster, rate: int) -> dict:
    # The gateway's default per-user limit is 50 sends/s (burst 200): enough
    # phones that the mean stays at 25/s each.
    users = max(200, -(-rate // 25))
    out = cluster.work / f"load-{rate}.json"
    argv = [args.load, "steady", "--url", cluster.url(), "--groups-file", str(cluster.groups),
            *cluster.admin_flags(), "--rate", str(rate), "--duration", f"{args.duration:g}s",
            "--users", str(users), "--quiet", "--json", str(out)]
    if not args.followers:
        argv.append("--no-followers")
    log_file = out.with_suffix(".log")
    log(f"{rate}/s: {' '.join(argv[1:])}")
    with open(log_file, "wb") as f:
        driver = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                  env={**os.environ, "IMDEDUP_TOKEN_SECRET": TOKEN_SECRET})
        time.sleep(1.5)  # the driver connects its phones first
        profiles = start_profiles(args, cluster, rate) if args.profile else []
        # Context switches over most of the sending phase (not the audit's
        # reads after it), per message acknowledged in that window.
        window = args.duration * 0.8
        before = {name: proc_switches(pid) for name, pid in cluster.pids.items()}
        time.sleep(window)
        switches = {name: proc_switches(pid) - before[name] for name, pid in cluster.pids.items()}
        code = driver.wait(timeout=args.duration + 300)
        if profiles:
            finish_profiles(args, rate, profiles)
    report = driver_report(out, log_file, code)
    report["exit"] = code
    report["switches_per_message"] = {
        name: n / max(report["achieved_rate"] * window, 1) for name, n in switches.items()}
    return report


def jetstream(args, pid: int, url: str, messages: int, rate: int) -> dict:
    argv = [args.jetstream_bench, "-url", url, "-messages", str(messages), "-rate", str(rate),
            "-resend-share", "0.11", "-in-flight", "256", "-handshake"]
    bench = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if bench.stdout.readline().strip() != "ready":
            raise HarnessError("jetstream-bench did not get ready")
        before = proc_cpu_seconds(pid)
        bench.stdin.write("go\n")
        bench.stdin.flush()
        result = json.loads(bench.stdout.readline())
        result["server_cpu_seconds"] = proc_cpu_seconds(pid) - before
        bench.stdin.write("done\n")
        bench.stdin.flush()
        bench.wait(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imdedup", required=True)
    parser.add_argument("--load", required=True)
    parser.add_argument("--jetstream-bench", required=True)
    parser.add_argument("--nats-server", default="nats-server")
    parser.add_argument("--rates", default="1000,3000,6000,13900")
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--followers", action="store_true",
                        help="let the driver's followers read every conversation while the load "
                             "runs (their reads then count in the services' CPU)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--worker-threads", type=int, default=1,
                        help="tokio worker threads of each service (TOKIO_WORKER_THREADS), as the "
                             "chart's one-core pods run them; 0: one per CPU (the driver is not "
                             "affected)")
    parser.add_argument("--commit-delay", default="3ms",
                        help="storage's --commit-delay (how long a batch that is not full waits "
                             "for more inserts before its commit)")
    parser.add_argument("--redis", default=os.environ.get("IMDEDUP_TEST_REDIS_URL"),
                        help="with --scylla: the ingest shards keep their window in this Redis "
                             "(default $IMDEDUP_TEST_REDIS_URL)")
    parser.add_argument("--scylla", default=None,
                        help="run on the real backends: the ingest shards write to this "
                             "ScyllaDB/Cassandra (host:port, a keyspace of the run's own) and "
                             "Redis, storage serves history from it. Keep the rates within what "
                             "the database takes")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="perf record every service while each rate runs; writes per service "
                             "and rate the top self-time symbols and (with inferno installed) a "
                             "flame graph to DIR. The profiler's own cost inflates the CPU figures "
                             "of such a run")
    args = parser.parse_args()
    if args.scylla and not args.redis:
        parser.error("--scylla needs --redis (or $IMDEDUP_TEST_REDIS_URL)")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    rates = [int(r) for r in args.rates.split(",")]
    # The services and the driver take flags from the environment: only this
    # script's flags count (no Redis, Scylla or trace export from the caller).
    for key in [k for k in os.environ if k.startswith(("IMDEDUP_", "OTEL_"))]:
        del os.environ[key]

    work = Path(tempfile.mkdtemp(prefix="imdedup-cpu-"))
    procs = Processes(work)
    rows = []
    try:
        cluster = Cluster(args, procs, work)
        cluster.up()
        nats_port = free_port()
        (work / "jetstream").mkdir()
        nats = procs.start("nats-server", [args.nats_server, "-a", "127.0.0.1", "-p", str(nats_port),
                                           "-js", "-sd", str(work / "jetstream")])
        wait_for("nats-server", lambda: port_open(nats_port), 30, procs)
        log(f"cluster and nats-server up; logs in {work}")
        idle = idle_cpu(cluster, IDLE_SECONDS)
        for rate in rates:
            report = drive(args, cluster, rate)
            cpu = {p["name"]: p["us_per_message"] for p in report.get("cpu", [])}
            js = jetstream(args, nats.pid, f"nats://127.0.0.1:{nats_port}", report["messages"], rate)
            js_us = js["server_cpu_seconds"] * 1e6 / max(js["acknowledged"], 1)
            rows.append({
                "offered": rate,
                "acked_per_s": report["achieved_rate"],
                "p99_ms": report["ack_latency"]["p99_ms"],
                "audit": "ok" if report["exit"] == 0 else "FAIL",
                "gateway": cpu.get("gateway"),
                "ingest": sum(cpu.get(n, 0.0) for n in cluster.names),
                "storage": cpu.get("storage"),
                "services": cpu.get("services"),
                "driver": cpu.get("driver"),
                "js_us": js_us,
                "js_acked_per_s": js["acknowledged_per_s"],
                "js_p99_ms": js["p99_ms"],
                "js_duplicates": js["duplicates"],
                "ratio": (cpu.get("services") or 0.0) / js_us if js_us else float("nan"),
                "sleeps": report["switches_per_message"],
            })
            log(f"{rate}/s: {json.dumps(rows[-1])}")
    except HarnessError as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        procs.stop_all()
    header = ("| offered | acked/s | p99 ms | audit | gateway µs | 2 ingest µs | storage µs "
              "| services µs | driver µs | JetStream µs | JS acked/s | JS p99 ms | services / JetStream |")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for r in rows:
        print(f"| {r['offered']:,}/s | {r['acked_per_s']:,.0f} | {r['p99_ms']:.1f} | {r['audit']} "
              f"| {r['gateway']:.0f} | {r['ingest']:.0f} | {r['storage']:.0f} | {r['services']:.0f} "
              f"| {r['driver']:.0f} | {r['js_us']:.1f} | {r['js_acked_per_s']:,.0f} "
              f"| {r['js_p99_ms']:.1f} | {r['ratio']:.1f}x |")
    print("(CPU µs per acknowledged message; JetStream: nats-server's CPU per acknowledged "
          "publish, 11% of them resends caught by Nats-Msg-Id)")
    print()
    names = list(cluster.pids)
    print("| offered | " + " | ".join(f"{n} sleeps/msg" for n in names) + " |")
    print("|" + " --- |" * (len(names) + 1))
    for r in rows:
        print(f"| {r['offered']:,}/s | " + " | ".join(f"{r['sleeps'][n]:.1f}" for n in names) + " |")
    print("(voluntary context switches per acknowledged message, every thread of the process, "
          "over the middle 80% of the sending phase: a thread put to sleep and woken again)")
    print(f"idle, before any load ({IDLE_SECONDS} s): "
          + ", ".join(f"{n} {ms:.1f} ms CPU/s" for n, ms in idle.items()))
    print()
    for r in rows:
        goal = r["ratio"] <= GOAL_RATIO
        print(f"goal at {r['offered']:,}/s (services <= {GOAL_RATIO}x JetStream): "
              f"{'met' if goal else 'NOT met'} ({r['services']:.0f} µs, {r['ratio']:.1f}x)")
    if args.keep:
        print(f"logs and reports in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print("cpu-per-message: services/JetStream "
          + ", ".join(f"{r['offered']}/s {r['ratio']:.1f}x" for r in rows))
    return 0 if all(r["audit"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
