#!/usr/bin/env python3
"""A configuration change rolls exactly the pods it concerns.

    checksums.py HELM CHART

Renders the chart with a base set of values and with one value changed at a
time, and compares the pod templates' checksum/config and checksum/secret
annotations of the gateway, ingest and storage workloads: the components
the change concerns must get a new checksum (so Kubernetes rolls them), the
others must keep theirs (and their whole pod template: any change to it
rolls them too), and the same values must give the same checksums.
(helm-unittest renders one release at a time, so this comparison of two
renders lives here.) Prints one line per case and `checks: N passed, M failed`.
"""

import hashlib
import json
import subprocess
import sys

import yaml

BASE = ["--set", "auth.tokenSecret=chart-test-token-secret-0123456789abcdef"]
COMPONENTS = ("gateway", "ingest", "storage")

# (what changes, --set arguments, {component: annotations that must change})
CASES = [
    ("nothing (same values, same checksums)", [], {}),
    ("gateway.config.sendTimeout", ["--set", "gateway.config.sendTimeout=9s"], {"gateway": {"checksum/config"}}),
    ("ingest.replicas (the shard list)", ["--set", "ingest.replicas=3"],
     {"gateway": {"checksum/config"}, "ingest": {"checksum/config"}}),
    ("gateway.config.limits.idleTimeout", ["--set", "gateway.config.limits.idleTimeout=2m"],
     {"gateway": {"checksum/config"}}),
    ("ingest.config.windowTtl", ["--set", "ingest.config.windowTtl=10m"], {"ingest": {"checksum/config"}}),
    ("ingest.config.overload.dbConcurrencyMax", ["--set", "ingest.config.overload.dbConcurrencyMax=256"],
     {"ingest": {"checksum/config"}}),
    ("storage.config.maxBatch", ["--set", "storage.config.maxBatch=64"], {"storage": {"checksum/config"}}),
    ("config.logLevel (every service)", ["--set", "config.logLevel=debug"],
     {c: {"checksum/config"} for c in COMPONENTS}),
    ("auth.tokenSecret", ["--set", "auth.tokenSecret=another-token-secret-0123456789abcdef"],
     {c: {"checksum/secret"} for c in COMPONENTS}),
    ("redis.password", ["--set", "redis.url=redis://redis:6379", "--set", "redis.password=pw2"],
     {c: {"checksum/secret"} for c in COMPONENTS} | {"ingest": {"checksum/config", "checksum/secret"}}),
    ("internalTls.enabled=false (plaintext, http:// URLs)", ["--set", "internalTls.enabled=false"],
     {c: {"checksum/config"} for c in COMPONENTS}),
    ("config.grpcReflection (the gRPC servers)", ["--set", "config.grpcReflection=true"],
     {"ingest": {"checksum/config"}, "storage": {"checksum/config"}}),
    # cert-manager renews the certificates in the mounted Secrets and the
    # services reload them: certificate settings never roll a pod.
    ("internalTls.certManager.duration and privateKey (renewals do not restart)",
     ["--set", "internalTls.certManager.duration=4320h", "--set", "internalTls.certManager.privateKey.algorithm=RSA",
      "--set", "internalTls.certManager.privateKey.size=3072"], {}),
]


def checksums(helm, chart, extra):
    out = subprocess.run([helm, "template", "imdedup", chart, "--namespace", "imdedup", *BASE, *extra],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    found = {}
    for doc in yaml.safe_load_all(out.stdout):
        if not doc or doc.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        component = doc["metadata"]["labels"].get("app.kubernetes.io/component")
        annotations = doc["spec"]["template"]["metadata"].get("annotations") or {}
        found[component] = {k: v for k, v in annotations.items() if k.startswith("checksum/")}
        template = json.dumps(doc["spec"]["template"], sort_keys=True).encode()
        found[component]["pod template"] = hashlib.sha256(template).hexdigest()
    return found


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    helm, chart = sys.argv[1:]
    base = checksums(helm, chart, [])
    passed = failed = 0
    for name, args, expect in CASES:
        problems = []
        try:
            changed = checksums(helm, chart, args)
        except RuntimeError as e:
            problems.append(str(e))
            changed = {}
        for component in COMPONENTS if changed else ():
            before, after = base.get(component, {}), changed.get(component, {})
            for key in ("checksum/config", "checksum/secret"):
                moved = before.get(key) != after.get(key)
                want = key in expect.get(component, set())
                if key not in after and key not in before:
                    if want:
                        problems.append(f"{component} has no {key}")
                elif moved != want:
                    problems.append(f"{component} {key} {'changed' if moved else 'did not change'}")
            if component not in expect and before.get("pod template") != after.get("pod template"):
                problems.append(f"{component}'s pod template changed (its pods would roll)")
        if problems:
            failed += 1
            print(f"FAIL checksums: {name} rolls exactly what it concerns\n     " + "; ".join(problems))
        else:
            passed += 1
            print(f"ok   checksums: {name} rolls exactly what it concerns")
    print(f"checks: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
