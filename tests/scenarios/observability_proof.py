#!/usr/bin/env python3
"""Proof that imdedup's dashboard and alert rules work against a real Prometheus.

Run by tests/scenarios/observability-proof.sh (which installs Prometheus and Redis
and builds the binaries); see that script for the overview. Python 3.11 standard
library only.

  1. Static checks: `promtool check rules`, `promtool test rules` (the unit tests
     next to the rules) and the dashboard's structure (variables, datasources,
     every panel's targets and label filters).
  2. A cluster on loopback, one process per service: storage (embedded SQLite),
     two ingest shards (ingest-0, ingest-1) on a Redis of their own, a gateway;
     each with its admin port. A Prometheus scrapes the four admin ports every
     second with the static label namespace="imdedup-proof" and loads the rules.
  3. Load with duplicates: imdedup-load steady (lost sends and lost ACKs, so
     phones resend; some simultaneous copies on a second connection). During the
     run three faults make the error series real: Redis is paused (SIGSTOP), so
     the shards bypass the window; storage is killed and restarted, so the
     shards' store calls fail; the SQLite database is locked by another
     connection for longer than the store's busy timeout, a database error.
     Beside the phones, imdedup-load business: backend systems call the
     business API and retry with the same idempotency key when an answer is
     lost.
  4. Every PromQL expression of the dashboard (instant, over a range covering
     the run, and as Grafana runs it: a range query with a 4 s
     $__rate_interval) and every rule (each recording rule, and each operand of
     each alert's condition, since an alert that is not firing legitimately
     returns nothing) is evaluated through the HTTP API and must return data,
     except where every missing series is listed in NOT_IN_PROOF (the CQL
     store's LWT leases; reported as not applicable). The label_values() of the
     $namespace and $shard variables must list the proof's namespace and shards.
     Prometheus must have loaded every rule, healthy; the alerts for the
     window bypass and the storage errors must be pending (their `for:` is
     minutes).
  5. The dedup hit rate from Prometheus must agree with the load driver's own
     counts (report.json, business.json) within 1% (relative), and so must the
     business key's share of the gateway's answered sends.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from localprocs import HarnessError, Processes, free_port, http_get, port_open, wait_for

NAMESPACE = "imdedup-proof"
TOKEN_SECRET = "observability-proof-secret-0123456789"
# The business API's service tokens (imdedup-load business).
SERVICE_TOKEN_SECRET = "observability-proof-service-secret-0123456789"
SHARDS = ("ingest-0", "ingest-1")
# Grafana's built-in variables, replaced the way Grafana would for the proof's
# queries. $__rate_interval is max($__interval + scrape, 4 x scrape).
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s",
                    "__range_ms"}
# The gateway's answers that were repeats, and all it answered with an ACK.
DUP = 'outcome=~"duplicate_window|duplicate_unique_key|duplicate_business_key"'
ACKED = 'outcome=~"stored|duplicate_window|duplicate_unique_key|duplicate_business_key"'
# Series the proof's cluster cannot produce, and why. An expression that returns
# nothing only because all its missing series are listed here is reported as
# not applicable instead of failing; any other empty result fails.
NOT_IN_PROOF = {
    "imdedup_store_seq_leases_total": "seq and server-id block leases (LWTs) exist only on the CQL "
                                      "store (ScyllaDB/Cassandra); the proof's storage is SQLite",
    "imdedup_store_nodes_stalled": "database nodes routed around exist only on the CQL store "
                                   "(ScyllaDB/Cassandra); the proof's storage is SQLite",
}
# The alerts the injected faults must set off (pending: their `for:` is minutes).
EXPECTED_ALERTS = ("ImdedupWindowBypassed", "ImdedupStorageErrors")


ProofError = HarnessError


_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"proof: [{time.monotonic() - _T0:5.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------- Prometheus

class Prometheus:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def api(self, path: str, params: dict | None = None, post: bool = True) -> dict:
        """GET, or POST for the query endpoints (long expressions fit in a form body)."""
        encoded = urllib.parse.urlencode(params or {}, doseq=True)
        if post and params:
            req = urllib.request.Request(self.base + path, data=encoded.encode())
        else:
            req = urllib.request.Request(self.base + path + (f"?{encoded}" if encoded else ""))
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                body = json.loads(raw)
            except ValueError:
                raise ProofError(f"Prometheus {path}: HTTP {e.code} {raw[:200]!r}")
        if body.get("status") != "success":
            raise ProofError(f"Prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float) -> list:
        data = self.api("/api/v1/query", {"query": expr, "time": f"{at:.3f}"})
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list:
        return self.api("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}",
                                                "end": f"{end:.3f}", "step": f"{step}"})["result"]

    def scalar(self, expr: str, at: float) -> float:
        result = self.query(expr, at)
        if len(result) != 1:
            raise ProofError(f"expected one series from {expr}, got {len(result)}")
        return float(result[0]["value"][1])


def finite_values(result: list) -> list[float]:
    out = []
    for series in result:
        points = series.get("values") or [series["value"]]
        out.extend(float(v) for _, v in points if math.isfinite(float(v)))
    return out


# ------------------------------------------------------------------ PromQL

_SET_OPS = ("and", "or", "unless")
_CMP_OPS = ("==", "!=", ">=", "<=", ">", "<")
_MODIFIER = re.compile(r"^\s*(bool\b|on\s*\([^)]*\)|ignoring\s*\([^)]*\)|"
                       r"group_left\s*(\([^)]*\))?|group_right\s*(\([^)]*\))?)\s*")
_NUMBER = re.compile(r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$")


def _split_top(expr: str, ops: tuple[str, ...]) -> list[str]:
    """Split at operators outside (), {}, [] and strings; keyword ops need word boundaries."""
    parts, depth, i, start, quote = [], 0, 0, 0, None
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            for op in ops:
                if not expr.startswith(op, i):
                    continue
                if op[0].isalpha():
                    before = expr[i - 1] if i else " "
                    after = expr[i + len(op)] if i + len(op) < len(expr) else " "
                    if before.isalnum() or before in "_:" or after.isalnum() or after in "_:":
                        continue
                parts.append(expr[start:i])
                i += len(op)
                start = i
                break
            else:
                i += 1
                continue
            continue
        i += 1
    parts.append(expr[start:])
    return parts


def _strip_modifiers(expr: str) -> str:
    while True:
        m = _MODIFIER.match(expr)
        if not m or not m.group(0).strip():
            return expr.strip()
        expr = expr[m.end():]


def condition_operands(expr: str) -> list[str]:
    """The operands of an alert condition: split at top-level and/or/unless, then at
    comparisons; number literals (the thresholds) are dropped."""
    operands = []
    for part in _split_top(expr, _SET_OPS):
        for side in _split_top(_strip_modifiers(part), _CMP_OPS):
            side = _strip_modifiers(side)
            if side and not _NUMBER.match(side):
                operands.append(side)
    return operands


# ------------------------------------------------------------------ dashboard

INGEST_METRIC = re.compile(r"^imdedup_(ingest|window|storage)_")
SELECTOR = re.compile(r"\b(imdedup_[a-z_]+)(\{[^}]*\})?")
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def check_dashboard(path: Path) -> tuple[dict, list[tuple[str, str, str]]]:
    """Validate the dashboard's structure; return it and (panel, refId, expr) for every target."""
    problems = []
    try:
        dash = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProofError(f"{path}: not valid JSON: {e}")
    for key, kind in [("uid", str), ("title", str), ("schemaVersion", int), ("panels", list),
                      ("templating", dict)]:
        if not isinstance(dash.get(key), kind):
            problems.append(f"top-level {key!r} missing or not a {kind.__name__}")
    if "__inputs" in dash or "__requires" in dash:
        problems.append("__inputs/__requires present: the dashboard must be self-contained "
                        "(datasource chosen by the $datasource variable)")
    if isinstance(dash.get("schemaVersion"), int) and dash["schemaVersion"] < 36:
        problems.append(f"schemaVersion {dash['schemaVersion']} is older than 36")
    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    ds_ref = {"type": "prometheus", "uid": "${datasource}"}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        problems.append("variable 'datasource' must be of type datasource with query prometheus")
    for name in ("namespace", "shard"):
        v = variables.get(name)
        if not v or v.get("type") != "query":
            problems.append(f"variable {name!r} missing or not a query variable")
            continue
        if v.get("datasource") != ds_ref:
            problems.append(f"variable {name!r} must query {ds_ref}")
        if not str(v.get("query", "")).startswith("label_values("):
            problems.append(f"variable {name!r} must use label_values(...)")
    targets, ids, boxes = [], set(), []
    for panel in dash.get("panels", []):
        title = panel.get("title") or f"panel {panel.get('id')}"
        pid = panel.get("id")
        if not isinstance(pid, int) or pid in ids:
            problems.append(f"{title}: id {pid!r} missing or duplicate")
        ids.add(pid)
        g = panel.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in "hwxy") or g["x"] + g["w"] > 24:
            problems.append(f"{title}: bad gridPos {g}")
        else:
            for other_title, o in boxes:
                if (g["x"] < o["x"] + o["w"] and o["x"] < g["x"] + g["w"]
                        and g["y"] < o["y"] + o["h"] and o["y"] < g["y"] + g["h"]):
                    problems.append(f"{title}: overlaps {other_title}")
            boxes.append((title, g))
        if panel.get("type") == "row":
            if panel.get("panels"):
                problems.append(f"row {title}: collapsed rows hide their panels from this check")
            continue
        if panel.get("type") not in ("timeseries", "stat", "gauge", "bargauge", "table"):
            problems.append(f"{title}: unexpected panel type {panel.get('type')!r}")
        if not panel.get("description"):
            problems.append(f"{title}: no description")
        if panel.get("datasource") != ds_ref:
            problems.append(f"{title}: datasource must be {ds_ref}")
        refs = set()
        if not panel.get("targets"):
            problems.append(f"{title}: no targets")
        for t in panel.get("targets", []):
            expr, ref = t.get("expr"), t.get("refId")
            if not expr:
                problems.append(f"{title}: a target without expr")
                continue
            if ref in refs or not ref:
                problems.append(f"{title}: refId {ref!r} missing or duplicate")
            refs.add(ref)
            if t.get("datasource") != ds_ref:
                problems.append(f"{title} {ref}: datasource must be {ds_ref}")
            for m in VARIABLE.finditer(expr):
                var = m.group(1) or m.group(2)
                if var not in variables and var not in GRAFANA_BUILTINS:
                    problems.append(f"{title} {ref}: unknown variable ${var}")
            for m in SELECTOR.finditer(expr):
                metric, labels = m.group(1), m.group(2) or ""
                if 'namespace=~"$namespace"' not in labels:
                    problems.append(f"{title} {ref}: {metric} not filtered by namespace=~\"$namespace\"")
                if INGEST_METRIC.match(metric) and 'shard=~"$shard"' not in labels:
                    problems.append(f"{title} {ref}: ingest metric {metric} not filtered by shard=~\"$shard\"")
            if "rate(" in expr and "$__rate_interval" not in expr:
                problems.append(f"{title} {ref}: rate() without $__rate_interval")
            targets.append((title, ref, expr))
    if problems:
        raise ProofError(f"{path} is not a valid dashboard:\n  " + "\n  ".join(problems))
    return dash, targets


def grafana_expand(expr: str, rate_interval: str, shard: str = ".*") -> str:
    values = {"datasource": "", "namespace": NAMESPACE, "shard": shard,
              "__rate_interval": rate_interval, "__interval": "1s", "__range": rate_interval}

    def sub(m):
        return values[m.group(1) or m.group(2)]
    return VARIABLE.sub(sub, expr)


# --------------------------------------------------------------------- faults

def pause(proc: subprocess.Popen, seconds: float, note: list) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    note.append(f"paused pid {proc.pid} for {seconds} s")
    time.sleep(seconds)
    os.kill(proc.pid, signal.SIGCONT)


def restart(procs: "Processes", name: str, argv: list[str], env: dict, down: float, note: list) -> None:
    """SIGKILL a service (no drain: a crash), and start it again on the same ports."""
    with procs.lock:
        for i, (child, proc) in enumerate(procs.children):
            if child == name:
                proc.kill()
                proc.wait()
                del procs.children[i]
                break
    note.append(f"killed {name}, restarted after {down} s")
    time.sleep(down)
    procs.start(f"{name}-restarted", argv, env)


def lock_database(db: Path, seconds: float, note: list) -> None:
    conn = sqlite3.connect(db, timeout=10, isolation_level=None)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        note.append(f"locked {db.name} for {seconds} s")
        time.sleep(seconds)
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def run_fault(at: float, fn, *args) -> threading.Thread:
    errors: list = []

    def body():
        time.sleep(at)
        try:
            fn(*args)
        except Exception as e:  # reported after the run
            errors.append(e)
    t = threading.Thread(target=body, daemon=True)
    t.errors = errors  # type: ignore[attr-defined]
    t.start()
    return t


# ----------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--imdedup", required=True)
    ap.add_argument("--load", required=True, help="the imdedup-load binary")
    ap.add_argument("--rules", required=True)
    ap.add_argument("--rules-test", required=True)
    ap.add_argument("--dashboard", required=True)
    ap.add_argument("--prometheus", default="prometheus")
    ap.add_argument("--promtool", default="promtool")
    ap.add_argument("--redis-server", default="redis-server")
    ap.add_argument("--rate", type=int, default=300)
    ap.add_argument("--duration", type=int, default=20, help="seconds of load")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, TSDB, report)")
    args = ap.parse_args()

    started = time.monotonic()
    rules, rules_test, dashboard = Path(args.rules).resolve(), Path(args.rules_test).resolve(), Path(args.dashboard)

    # 1. Static checks.
    for argv in ([args.promtool, "check", "rules", str(rules)],
                 [args.promtool, "test", "rules", str(rules_test)]):
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            raise ProofError(f"{' '.join(argv[1:3])} failed:\n{r.stdout}{r.stderr}")
        log(f"promtool {' '.join(argv[1:3])}: {r.stdout.strip().splitlines()[-1].strip()}")
    m = re.search(r"(\d+) rules found", subprocess.run(
        [args.promtool, "check", "rules", str(rules)], capture_output=True, text=True).stdout)
    rules_in_file = int(m.group(1)) if m else None
    dash, targets = check_dashboard(dashboard)
    log(f"dashboard {dash['uid']!r}: {sum(1 for p in dash['panels'] if p.get('type') != 'row')} panels, "
        f"{len(targets)} targets, structure valid")

    tmp = Path(tempfile.mkdtemp(prefix="imdedup-obs-proof."))
    procs = Processes(tmp)
    ok = False
    try:
        ok = run(args, tmp, procs, rules, rules_in_file, targets, dash, started)
    finally:
        procs.stop_all()
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"logs, report and TSDB kept in {tmp}")
    return 0 if ok else 1


def run(args, tmp: Path, procs: Processes, rules: Path, rules_in_file, targets, dash, started) -> bool:
    # 2. The cluster and Prometheus.
    ports = {name: free_port() for name in
             ("storage", "storage-admin", "ingest-0", "ingest-0-admin", "ingest-1", "ingest-1-admin",
              "gateway", "gateway-admin", "redis", "prometheus")}
    addr = lambda name: f"127.0.0.1:{ports[name]}"
    data = tmp / "storage-data"
    # The gateway's groups file; the load driver adds its run's groups.
    groups_file = tmp / "groups.json"
    groups_file.write_text("{}")
    data.mkdir()
    quiet = {"RUST_LOG": "warn"}
    redis = procs.start("redis", [args.redis_server, "--bind", "127.0.0.1", "--port", str(ports["redis"]),
                                  "--save", "", "--appendonly", "no", "--dir", str(tmp)])
    wait_for("redis", lambda: port_open(ports["redis"]), 10, procs)
    # Plaintext between the services here (the fault scenarios run mutual
    # TLS): this proves the dashboard and rules, not the transport.
    storage_argv = [args.imdedup, "storage", "--insecure-plaintext", "--listen", addr("storage"),
                    "--admin-listen", addr("storage-admin"), "--data-dir", str(data), "--grace", "1s"]
    procs.start("storage", storage_argv, quiet)
    for shard in SHARDS:
        procs.start(shard, [args.imdedup, "ingest", "--insecure-plaintext", "--listen", addr(shard),
                            "--admin-listen", addr(f"{shard}-admin"), "--shard-name", shard,
                            "--storage", f"http://{addr('storage')}",
                            "--redis", f"redis://{addr('redis')}", "--redis-timeout", "100ms",
                            "--storage-timeout", "8s", "--grace", "1s"], quiet)
    procs.start("gateway", [args.imdedup, "gateway", "--insecure-plaintext",
                            "--listen", addr("gateway"),
                            "--admin-listen", addr("gateway-admin"),
                            "--shards", ",".join(f"http://{addr(s)}" for s in SHARDS),
                            "--storage", f"http://{addr('storage')}", "--send-timeout", "10s",
                            "--groups-file", str(groups_file), "--grace", "1s"],
                {**quiet, "IMDEDUP_TOKEN_SECRET": TOKEN_SECRET,
                 "IMDEDUP_SERVICE_TOKEN_SECRET": SERVICE_TOKEN_SECRET})
    admin = {"storage": "storage-admin", "ingest-0": "ingest-0-admin", "ingest-1": "ingest-1-admin",
             "gateway": "gateway-admin"}
    for service, port_name in admin.items():
        wait_for(f"{service} /readyz", lambda p=port_name: http_get(f"http://{addr(p)}/readyz")[0] == 200,
                 60, procs)
    for service, port_name in admin.items():
        status, body = http_get(f"http://{addr(port_name)}/metrics")
        if status != 200:  # series appear with traffic; the storage has none before it
            raise ProofError(f"{service} GET /metrics: HTTP {status} {body[:200]!r}")

    def job(name, services):
        return {"job_name": name, "scrape_interval": "1s", "scrape_timeout": "900ms",
                "static_configs": [{"targets": [addr(admin[s]) for s in services],
                                    "labels": {"namespace": NAMESPACE}}]}
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(rules)],
              "scrape_configs": [job("imdedup-storage", ["storage"]),
                                 job("imdedup-ingest", list(SHARDS)),
                                 job("imdedup-gateway", ["gateway"])]}
    # JSON is YAML: no YAML library needed.
    (tmp / "prometheus.yml").write_text(json.dumps(config, indent=2))
    procs.start("prometheus", [args.prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp / 'tsdb'}",
                               f"--web.listen-address={addr('prometheus')}", "--log.level=warn"])
    prom = Prometheus(ports["prometheus"])
    wait_for("Prometheus /-/ready", lambda: http_get(f"{prom.base}/-/ready")[0] == 200, 30, procs)

    def all_up():
        active = prom.api("/api/v1/targets")["activeTargets"]
        return len(active) == 4 and all(t["health"] == "up" for t in active)
    wait_for("Prometheus to scrape all four admin ports", all_up, 20, procs)
    log(f"cluster up: storage, {', '.join(SHARDS)}, gateway, redis; Prometheus on {addr('prometheus')}")

    # 3. Load with duplicates, and three faults.
    report_path = tmp / "report.json"
    load_argv = [args.load, "steady", "--url", f"ws://{addr('gateway')}/v1/ws",
                 "--groups-file", str(groups_file),
                 "--token-secret", TOKEN_SECRET, "--rate", str(args.rate),
                 "--duration", f"{args.duration}s", "--loss-send", "0.05", "--loss-ack", "0.1",
                 "--time-scale", "0.05", "--concurrent-copies", "0.02", "--users", "20",
                 "--seed", "7", "--json", str(report_path), "--quiet"]
    t_load = time.time()
    load = subprocess.Popen(load_argv, stdout=open(tmp / "load.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    procs.children.append(("imdedup-load", load))
    # Beside the phones, backend systems call the business API and retry
    # with the same idempotency key when an answer is lost (20%). The client
    # timeout is long, so every answer the gateway counted is one the driver
    # saw, and their hit rates can be compared exactly.
    business_path = tmp / "business.json"
    business_argv = [args.load, "business", "--url", f"ws://{addr('gateway')}/v1/ws",
                     "--token-secret", TOKEN_SECRET, "--service-token-secret", SERVICE_TOKEN_SECRET,
                     "--rate", str(max(args.rate // 10, 10)), "--duration", f"{args.duration}s",
                     "--users", "10", "--systems", "4", "--call-timeout", "30s",
                     "--max-call-timeout", "30s", "--loss-ack", "0.2", "--seed", "7",
                     "--json", str(business_path), "--quiet"]
    business = subprocess.Popen(business_argv, stdout=open(tmp / "business.log", "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
    procs.children.append(("imdedup-load-business", business))
    notes: list[str] = []
    d = args.duration
    # Redis paused: the shards bypass the window. Storage killed and restarted:
    # the shards' store calls fail at once. The database locked by another
    # connection for longer than the store's 5 s busy timeout: the batch
    # waiting on it fails with "database is locked", a database error (the
    # shards' 8 s storage timeout lets that call finish, so it is counted).
    faults = [run_fault(0.2 * d, pause, redis, 1.5, notes),
              run_fault(0.4 * d, restart, procs, "storage", storage_argv, quiet, 1.5, notes),
              run_fault(0.6 * d, lock_database, data / "messages.db", 5.5, notes)]
    try:
        load.wait(timeout=d + 90)
    except subprocess.TimeoutExpired:
        raise ProofError(f"imdedup-load did not finish within {d + 90} s\n{procs.tail('imdedup-load')}")
    procs.children.remove(("imdedup-load", load))
    try:
        business.wait(timeout=90)
    except subprocess.TimeoutExpired:
        raise ProofError(f"imdedup-load business did not finish\n{procs.tail('imdedup-load-business')}")
    procs.children.remove(("imdedup-load-business", business))
    if business.returncode != 0:
        raise ProofError(f"imdedup-load business failed (status {business.returncode}):\n"
                         f"{procs.tail('imdedup-load-business', 30)}")
    for f in faults:
        f.join(timeout=15)
        if f.errors:  # type: ignore[attr-defined]
            raise ProofError(f"fault injection failed: {f.errors[0]}")  # type: ignore[attr-defined]
    if load.returncode != 0:
        raise ProofError(f"imdedup-load failed (status {load.returncode}; a failed audit exits 1):\n"
                         f"{procs.tail('imdedup-load', 30)}")
    t_done = time.time()
    procs.check_alive()
    report = json.loads(report_path.read_text())
    business_report = json.loads(business_path.read_text())
    log(f"load: {report['messages']} messages at {args.rate}/s for {d} s, {report['tries']} tries; "
        f"business: {business_report['messages']} notices, {business_report['tries']} calls; "
        f"faults: {'; '.join(notes)}")

    # Wait until every target was scraped after the last answer, and the rules ran on it.
    def scraped_after_load():
        active = prom.api("/api/v1/targets")["activeTargets"]
        return all(t["health"] == "up" and _ts(t["lastScrape"]) > t_done + 1 for t in active)
    wait_for("a scrape of every target after the load", scraped_after_load, 20, procs)
    time.sleep(2.5)  # two more rule evaluations (evaluation_interval 1s)
    at = time.time()
    run_range = f"{int(at - t_load) + 30}s"

    # 4. Every expression returns data.
    checked, failures, not_applicable = 0, [], {}
    exists: dict[str, bool] = {}

    def missing_metrics(expr: str) -> list[str]:
        for metric in {m.group(1) for m in SELECTOR.finditer(expr)}:
            if metric not in exists:
                exists[metric] = bool(prom.query(f"group({metric})", at))
        return sorted(m for m in {m.group(1) for m in SELECTOR.finditer(expr)} if not exists[m])

    def expect_data(label: str, expr: str, result: list) -> None:
        nonlocal checked
        checked += 1
        if result and finite_values(result):
            return
        missing = missing_metrics(expr)
        if not result and missing and all(m in NOT_IN_PROOF for m in missing):
            not_applicable[label] = "; ".join(NOT_IN_PROOF[m] for m in missing)
            return
        why = "no data" if not result else "only NaN/Inf"
        if missing:
            why += f" (no series at all for {', '.join(missing)})"
        failures.append(f"{label}: {why}\n      {expr}")

    for title, ref, expr in targets:
        label = f"dashboard {title!r} {ref}"
        expect_data(label, expr, prom.query(grafana_expand(expr, run_range), at))
        # As Grafana runs it: a range query with $__rate_interval = 4 x the 1 s scrape.
        expect_data(label + " (range, 4s)", expr,
                    prom.query_range(grafana_expand(expr, "4s"), t_load, at, 1))
        if "$shard" in expr:
            # One shard chosen: data, and only that shard's series.
            result = prom.query(grafana_expand(expr, run_range, SHARDS[1]), at)
            expect_data(label + f" ($shard={SHARDS[1]})", expr, result)
            others = {r["metric"]["shard"] for r in result if r["metric"].get("shard", SHARDS[1]) != SHARDS[1]}
            if others:
                failures.append(f"{label} with $shard={SHARDS[1]} returned shards {sorted(others)}\n      {expr}")
    for var, match, expected in [("namespace", "imdedup_ingest_shard_info", {NAMESPACE}),
                                 ("shard", f'imdedup_ingest_shard_info{{namespace=~"{NAMESPACE}"}}', set(SHARDS))]:
        values = set(prom.api(f"/api/v1/label/{var}/values", {"match[]": match}, post=False))
        checked += 1
        if not expected <= values:
            failures.append(f"variable ${var}: label_values({match}, {var}) gave {sorted(values)}, "
                            f"expected {sorted(expected)}")

    groups = prom.api("/api/v1/rules")["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    if rules_in_file is not None and len(loaded) != rules_in_file:
        failures.append(f"Prometheus loaded {len(loaded)} rules, the file has {rules_in_file}")
    alerts_seen = {}
    for rule in loaded:
        name = rule.get("name")
        if rule.get("health") != "ok" or rule.get("lastError"):
            failures.append(f"rule {name}: health {rule.get('health')} {rule.get('lastError', '')}")
        if rule["type"] == "recording":
            expect_data(f"recording rule {name}", rule["query"], prom.query(rule["query"], at))
            expect_data(f"recorded series {name}", name, prom.query(f'{name}{{namespace="{NAMESPACE}"}}', at))
        else:
            alerts_seen[name] = rule.get("state")
            for operand in condition_operands(rule["query"]):
                expect_data(f"alert {name} operand", operand, prom.query(operand, at))
    for name in EXPECTED_ALERTS:
        checked += 1
        if alerts_seen.get(name) not in ("pending", "firing"):
            failures.append(f"alert {name} is {alerts_seen.get(name)!r} after its fault was injected, "
                            f"expected pending or firing")

    # 5. Dedup hit rate: Prometheus against the driver's own counts.
    o = report["outcomes"]
    b = business_report["outcomes"]
    # The ingest counts the business calls too: a retry answered from its key
    # is a window or unique-key repeat there.
    driver_repeats = o["duplicate_window"] + o["duplicate_unique_key"] + b["duplicate_business_key"]
    driver_acked = o["stored"] + b["stored"] + driver_repeats
    driver_rate = driver_repeats / driver_acked
    # The business key's share of the gateway's answered sends (the panel's
    # "business key" line).
    driver_business_rate = b["duplicate_business_key"] / driver_acked
    # The rate is counted at the gateway (the recording rule's and the
    # dashboard's): a copy that joined a send in flight there never reaches
    # an ingest, and the business key's retries are answered there.
    sel = lambda outcome: f'imdedup_gateway_sends_total{{namespace="{NAMESPACE}",{outcome}}}'
    exact = prom.scalar(f"sum({sel(DUP)}) / sum({sel(ACKED)})", at)
    by_increase = prom.scalar(f"sum(increase({sel(DUP)}[{run_range}])) / "
                              f"sum(increase({sel(ACKED)}[{run_range}]))", at)
    counts = {r["metric"]["outcome"]: int(float(r["value"][1])) for r in prom.query(
        f'sum by (outcome) (imdedup_ingest_sends_total{{namespace="{NAMESPACE}"}})', at)}
    gw_counts = {r["metric"]["outcome"]: int(float(r["value"][1])) for r in prom.query(
        f'sum by (outcome) (imdedup_gateway_sends_total{{namespace="{NAMESPACE}"}})', at)}
    # The counters' values at the end are the run's totals (the processes started
    # at zero); increase() over the run is what a dashboard shows (the services
    # create every known series at 0, so it sees the first counts too). Both
    # must agree with the driver.
    rel = abs(exact - driver_rate) / driver_rate
    for how, value in (("counter totals", exact), ("increase() over the run", by_increase)):
        checked += 1
        if abs(value - driver_rate) / driver_rate >= 0.01:
            failures.append(f"dedup hit rate from Prometheus ({how}) {value:.4%} differs from the "
                            f"driver's {driver_rate:.4%} by more than 1% (relative)")

    gw_sel = lambda outcome: f'imdedup_gateway_sends_total{{namespace="{NAMESPACE}",{outcome}}}'
    gw_acked = 'outcome=~"stored|duplicate_window|duplicate_unique_key|duplicate_business_key"'
    gw_business = 'outcome="duplicate_business_key"'
    business_rate = prom.scalar(f"sum({gw_sel(gw_business)}) / sum({gw_sel(gw_acked)})", at)
    checked += 1
    if driver_business_rate <= 0 or abs(business_rate - driver_business_rate) / driver_business_rate >= 0.01:
        failures.append(f"business key hit rate from Prometheus {business_rate:.4%} differs from the "
                        f"driver's {driver_business_rate:.4%} by more than 1% (relative), or is 0")
    log(f"business:   stored {b['stored']}, retries caught by the business key "
        f"{b['duplicate_business_key']}, errors {b['errors']}; business key hit rate: driver "
        f"{driver_business_rate:.4%}, Prometheus {business_rate:.4%}")
    log(f"driver:     stored {o['stored']}, caught by the window {o['duplicate_window']}, "
        f"by the unique key {o['duplicate_unique_key']}, errors {o['errors']}")
    log(f"ingest:     {dict(sorted(counts.items()))}")
    log(f"gateway:    {dict(sorted(gw_counts.items()))}")
    log(f"dedup hit rate: driver {driver_rate:.4%}, Prometheus {exact:.4%} "
        f"(relative difference {rel:.3%}, allowed < 1%); over increase() {by_increase:.4%} "
        f"({abs(by_increase - driver_rate) / driver_rate:.3%})")
    for label, reason in not_applicable.items():
        log(f"not applicable: {label}: {reason}")
    log("alerts: " + ", ".join(f"{k} {v}" for k, v in sorted(alerts_seen.items())))
    if failures:
        log(f"FAILED: {len(failures)} of {checked} checks")
        for f in failures:
            print(f"  - {f}", flush=True)
        return False
    log(f"PASSED: {checked - len(not_applicable)} checks passed, {len(not_applicable)} not applicable "
        f"({len(targets)} dashboard targets, each instant, as a range query and with one shard chosen; "
        f"{len(loaded)} rules; "
        f"2 variables; {len(EXPECTED_ALERTS)} alerts set off; the hit rate) in "
        f"{time.monotonic() - started:.0f} s")
    return True


def _ts(rfc3339: str) -> float:
    """Prometheus's lastScrape timestamp (RFC 3339 with nanoseconds) as Unix seconds."""
    from datetime import datetime
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", rfc3339)
    if not m:
        return 0.0
    base = datetime.fromisoformat(m.group(1) + (m.group(3).replace("Z", "+00:00")))
    return base.timestamp() + float(m.group(2) or 0)


def _on_signal(signum, frame):
    print(f"proof: interrupted by signal {signum}; stopping everything", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, _on_signal)
    try:
        sys.exit(main())
    except ProofError as e:
        print(f"proof: FAILED: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
