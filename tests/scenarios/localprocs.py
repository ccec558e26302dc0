"""Processes of a local cluster on loopback, for the scenarios in
tests/scenarios/ (the observability proof, the fault and overload scenarios)
and bench/cpu_per_message.py. Python 3.11 standard library only."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


class HarnessError(Exception):
    """A harness step failed; the message says which and why."""


def driver_report(out: Path, log_file: Path, code: int | None) -> dict:
    """The JSON report the load driver wrote to `out`, or why there is none."""
    if not out.exists():
        raise HarnessError(f"the load driver wrote no report (exit {code}); log: {log_file}\n"
                           f"{log_file.read_text(errors='replace')[-2000:]}")
    return json.loads(out.read_text())


class Processes:
    """Every child a harness starts, stopped in reverse order whatever happens."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.lock = threading.Lock()  # a fault thread restarts a service
        self.stopping = False

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        with self.lock:
            if self.stopping:
                raise HarnessError(f"not starting {name}: shutting down")
            return self._start(name, argv, env)

    def _start(self, name: str, argv: list[str], env: dict | None) -> subprocess.Popen:
        out = open(self.logdir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        out.close()
        self.children.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None:
                raise HarnessError(f"{name} exited with status {proc.returncode}; "
                                 f"log: {self.logdir / (name + '.log')}\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            text = (self.logdir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + l for l in text[-lines:])

    def stop_all(self) -> None:
        with self.lock:
            self.stopping = True
        for name, proc in reversed(self.children):
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)  # a paused process cannot act on SIGTERM
                    proc.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for name, proc in reversed(self.children):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_ISSUED_PORTS: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range
    (32768 and up), which outgoing connections could take before the service
    binds it. Never the same port twice in one run: ports are handed out
    before their services bind them, so a port checked free a moment ago may
    already belong to another service of the same cluster (a CI run failed
    when an ingest's gRPC and admin ports were both given 29911)."""
    import random
    while True:
        port = random.randint(20000, 32000)
        if port in _ISSUED_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ISSUED_PORTS.add(port)
        return port


def metric_samples(body: bytes):
    """Each sample of a Prometheus text exposition (a `/metrics` body):
    its metric's name, the name with its labels as written, and the value
    as written."""
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        metric, _, value = line.rpartition(" ")
        yield metric.split("{")[0], metric, value


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(what: str, check, timeout: float, procs: Processes) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            if check():
                return
        except (OSError, ValueError) as e:
            last = e
        time.sleep(0.1)
    raise HarnessError(f"timed out after {timeout:.0f} s waiting for {what}" + (f" ({last})" if last else ""))


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
