#!/usr/bin/env python3
"""The services' gauges, read every quarter second during a run.

Reads each admin URL's `/metrics` every INTERVAL and prints one
tab-separated line per read: seconds since the first read, then for each
URL the value of each gauge asked for (summed over its labels; `-` if the
URL did not answer). Stops when every URL has stopped answering for
5 s, or after --seconds. By default the gauges that show how a drain after
a surge goes: the gateway's sends in flight, its limit, the backlog's
places, its held sends and whether it drains; an ingest's sends and
inserts in flight and its database limit; the embedded store's inserts at
its writer as a commit begins.

    bench/gauges.py http://127.0.0.1:35379 http://127.0.0.1:34043 > gauges.tsv
    bench/gauges.py URL... --gauge imdedup_gateway_held_sends --interval 0.1

The admin URLs of `imdedup dev` are in its first lines ("admin gateway
http://…/metrics"); a separate-process service's are its `--admin-listen`.
"""

import argparse
import sys
import time
from pathlib import Path

# localprocs.py (the process harness) is shared with the test scenarios.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "scenarios"))
from localprocs import http_get, metric_samples  # noqa: E402

DEFAULT_GAUGES = [
    "imdedup_gateway_sends_in_flight",
    "imdedup_gateway_admission_limit",
    "imdedup_gateway_backlog_places",
    "imdedup_gateway_held_sends",
    "imdedup_gateway_draining",
    "imdedup_ingest_sends_in_flight",
    "imdedup_ingest_db_in_flight",
    "imdedup_ingest_db_concurrency_limit",
    "imdedup_store_writer_queue",
]


def read(url: str, gauges: list[str], timeout: float) -> dict[str, float] | None:
    """The gauges' values at `url`, each summed over its labels; None if
    the URL did not answer."""
    try:
        status, body = http_get(url.rstrip("/") + "/metrics", timeout=timeout)
    except OSError:
        return None
    if status != 200:
        return None
    values: dict[str, float] = {}
    for name, _, value in metric_samples(body):
        if name in gauges:
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return values


def short(name: str) -> str:
    return name.removeprefix("imdedup_")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("urls", nargs="+", help="admin base URLs (http://host:port)")
    ap.add_argument("--gauge", action="append", dest="gauges",
                    help="a gauge to read (repeatable; default: the drain's)")
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long")
    args = ap.parse_args()
    gauges = args.gauges or DEFAULT_GAUGES
    if args.interval <= 0:
        ap.error("--interval must be above 0")

    # Each URL's columns: the gauges it showed at the first answer.
    columns: list[list[str] | None] = [None] * len(args.urls)
    start = time.monotonic()
    last_answer = start
    header_printed = False
    while args.seconds is None or time.monotonic() - start < args.seconds:
        at = time.monotonic()
        reads = [read(url, gauges, timeout=max(args.interval, 1.0)) for url in args.urls]
        if any(r is not None for r in reads):
            last_answer = at
        elif at - last_answer > 5:
            break
        for i, values in enumerate(reads):
            if columns[i] is None and values is not None:
                columns[i] = [g for g in gauges if g in values]
        if not header_printed and all(c is not None for c in columns):
            names = [f"{i}:{short(g)}" for i, cols in enumerate(columns) for g in cols]
            print("\t".join(["t", *names]), flush=True)
            header_printed = True
        if header_printed:
            row = [f"{at - start:.2f}"]
            for cols, values in zip(columns, reads):
                for g in cols:
                    row.append("-" if values is None else f"{values.get(g, 0):g}")
            print("\t".join(row), flush=True)
        time.sleep(max(0.0, args.interval - (time.monotonic() - at)))
    if not header_printed:
        silent = [url for url, cols in zip(args.urls, columns) if cols is None]
        print(f"gauges: no answer from {', '.join(silent)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
    except BrokenPipeError:
        sys.exit(0)
