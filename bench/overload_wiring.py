"""The load driver's overload scenario on the separate-process wiring.

Run by bench/overload-wiring.sh (which builds the binaries). Python 3.11
standard library only.

The cluster of bench/cpu_per_message.py (storage, two ingest shards and a
gateway as processes of their own on loopback, mutual TLS, one tokio worker
each by default; SQLite, or Cassandra/ScyllaDB and Redis with --scylla and
--redis), then `imdedup-load overload --url ... --groups-file ... --admin
NAME=URL ...` for every service against it, its output passed through; its
last line is the scenario's `overload: capacity C/s; at 1.5x ...` summary.
The exit status is the driver's (1 on a loss, a repeat or a missed message).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_per_message import TOKEN_SECRET, Cluster
from localprocs import HarnessError, Processes

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"overload-wiring: [{time.monotonic() - T0:5.1f}s] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imdedup", required=True)
    parser.add_argument("--load", required=True)
    parser.add_argument("--worker-threads", type=int, default=1,
                        help="tokio worker threads of each service (TOKIO_WORKER_THREADS); "
                             "0: one per CPU")
    parser.add_argument("--commit-delay", default="3ms", help="storage's --commit-delay (SQLite)")
    parser.add_argument("--redis", default=os.environ.get("IMDEDUP_TEST_REDIS_URL"),
                        help="with --scylla: the ingest shards' Redis")
    parser.add_argument("--scylla", default=None,
                        help="run on the real backends: this ScyllaDB/Cassandra (host:port), a "
                             "keyspace of the run's own")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--pin", action="store_true",
                        help="the services on the first CPU and the driver on the second, so the "
                             "driver's CPU, which grows with the load it offers, is not taken from "
                             "the services (needs two CPUs)")
    parser.add_argument("driver", nargs=argparse.REMAINDER,
                        help="after --: more flags for `imdedup-load overload` (default: "
                             "--group-share 0 --no-followers)")
    args = parser.parse_args()
    if args.scylla and not args.redis:
        parser.error("--scylla needs --redis (or $IMDEDUP_TEST_REDIS_URL)")
    driver_flags = [f for f in args.driver if f != "--"] or ["--group-share", "0", "--no-followers"]
    # Only this script's flags count (no Redis, Scylla or trace export from
    # the caller's environment).
    for key in [k for k in os.environ if k.startswith(("IMDEDUP_", "OTEL_"))]:
        del os.environ[key]

    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2:
        parser.error("--pin needs two CPUs")
    driver_cpus = set(cpus[1:2]) if args.pin else set(cpus)
    if args.pin:
        # The services inherit this process's CPU; the driver gets its own.
        os.sched_setaffinity(0, {cpus[0]})
    work = Path(tempfile.mkdtemp(prefix="imdedup-overload-wiring-"))
    procs = Processes(work)
    try:
        cluster = Cluster(args, procs, work)
        cluster.up()
        argv = [args.load, "overload", "--url", cluster.url(), "--groups-file",
                str(cluster.groups), *cluster.admin_flags(), *driver_flags]
        log(f"cluster up; logs in {work}; {' '.join(argv[1:])}")
        code = subprocess.call(argv, env={**os.environ, "IMDEDUP_TOKEN_SECRET": TOKEN_SECRET},
                               preexec_fn=lambda: os.sched_setaffinity(0, driver_cpus))
    except HarnessError as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        procs.stop_all()
    if args.keep:
        log(f"logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
