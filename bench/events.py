#!/usr/bin/env python3
"""What a run's messages waited for, second by second of when they were due.

Reads the file `imdedup-load … --events FILE` writes (one tab-separated line
per message: due ms, latency ms or `-`, tries, sends held back, then each
step: `L` lost on the way up, `H` held back by the phone's throttle, `R` an
error (`:code`), `A` an ACK, `a` an ACK lost on the way down, `C` no
connection; each with the ms after due it happened, for an answer when it
came back, and `+ms` the wait asked for). For each second from FROM, prints the messages' latency percentiles
and their most common paths: slow or not (answered within --slow, default
5 s), the first step, and the kinds of step on the way; with one example of
each slow path.

    bench/events.py FILE --from 55 [--seconds 5] [--slow 5] [--paths 6]
"""

import argparse
import collections
import sys


def read(path):
    for line in open(path, encoding="utf-8"):
        due, latency, tries, held, steps = line.rstrip("\n").split("\t")
        yield (
            int(due),
            None if latency == "-" else int(latency),
            int(tries),
            int(held),
            steps.split(),
        )


def quantile(latencies, q):
    value = latencies[min(len(latencies) - 1, int(len(latencies) * q))]
    return "never" if value is None else f"{value} ms"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--from", dest="start", type=float, required=True, help="first second (of the run)")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--slow", type=float, default=5.0, help="seconds: answered later is slow")
    parser.add_argument("--paths", type=int, default=6, help="paths shown per second")
    args = parser.parse_args()
    start_ms = int(args.start * 1000)
    by_second = collections.defaultdict(list)
    for message in read(args.file):
        second = (message[0] - start_ms) // 1000
        if 0 <= second < args.seconds:
            by_second[second].append(message)
    if not by_second:
        sys.exit(f"no message due in the {args.seconds} s from {args.start} s")
    for second in range(args.seconds):
        messages = by_second.get(second, [])
        if not messages:
            continue
        latencies = sorted(
            (m[1] for m in messages), key=lambda l: float("inf") if l is None else l
        )
        held = sum(1 for m in messages if m[3])
        refused = sum(1 for m in messages if any(s[0] == "R" for s in m[4]))
        print(
            f"due {args.start + second:g}-{args.start + second + 1:g} s: {len(messages)} messages, "
            f"p50 {quantile(latencies, 0.5)}, p90 {quantile(latencies, 0.9)}, "
            f"p99 {quantile(latencies, 0.99)}; held back {held}, refused {refused}"
        )
        paths = collections.Counter()
        example = {}
        for message in messages:
            latency, steps = message[1], message[4]
            slow = latency is None or latency > args.slow * 1000
            path = (
                "gave up" if latency is None else "slow" if slow else "in time",
                steps[0][0] if steps else "-",
                "".join(sorted({s[0] for s in steps})),
            )
            paths[path] += 1
            if slow:
                example.setdefault(path, " ".join(steps[:8]) + (" …" if len(steps) > 8 else ""))
        for path, count in paths.most_common(args.paths):
            outcome, first, kinds = path
            line = f"  {count:6d}  {outcome:8s} first {first}  steps {kinds}"
            if path in example:
                line += f"   e.g. {example[path]}"
            print(line)


if __name__ == "__main__":
    main()
