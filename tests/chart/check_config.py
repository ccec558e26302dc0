#!/usr/bin/env python3
"""Check every imdedup container of rendered chart manifests against the real binary.

    check_config.py IMDEDUP_BIN RENDER.yaml...

For every Deployment, StatefulSet and Job container that runs imdedup (its
image's repository ends in "imdedup", or its command is imdedup), in every
render:

1. every IMDEDUP_* variable the container sets (env, and envFrom of a
   ConfigMap or Secret of the same render) must be one the subcommand knows:
   clap ignores unknown environment variables, so a misspelt one would
   otherwise pass silently. The known names are read from
   `imdedup <subcommand> --help`, which prints `[env: IMDEDUP_...]` for every
   flag;
2. `imdedup --check-config <the container's args>` must exit 0, run in an
   environment made only of the container's: values as rendered (with
   Kubernetes' $(VAR) expansion), Secret references replaced by plausible
   placeholders, fieldRef metadata.name by the pod's name (every ordinal of a
   StatefulSet), and the paths of mounted volumes moved into a scratch
   directory holding placeholder files (a real self-signed PEM for CA keys).
   The internal TLS files (IMDEDUP_TLS_CERT, _KEY, _CA in a Secret volume)
   get a real certificate, key and CA made by `imdedup certs`, so the binary
   really loads and matches them.

Then, once per render, the internal TLS wiring (`internal TLS` lines): every
gRPC hop is TLS or every hop is plaintext, with https:// or http:// URLs to
match; and where the render issues the certificates (cert-manager
Certificates), every server's certificate is valid for the hosts its callers
dial (IMDEDUP_SHARDS, IMDEDUP_STORAGE_URL; wildcards as in HTTPS) with the
`server auth` usage, every caller's has `client auth`, and every server's
IMDEDUP_TLS_ALLOW_CLIENTS names each of its callers' certificates. (With
internalTls.existingSecrets the names are the user's PKI's: not checked.)

Prints one line per check and exits non-zero if any failed. The last line is
`checks: N passed, M failed` for chart-test.sh to add up.
"""

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

WORKLOADS = {"Deployment", "StatefulSet", "Job"}

# Placeholders for values that come from Secrets, by the variable's name.
SECRET_PLACEHOLDERS = {
    "IMDEDUP_TOKEN_SECRET": "x" * 48,
    "IMDEDUP_SERVICE_TOKEN_SECRET": "y" * 48,
    "IMDEDUP_REDIS_URL": "redis://:pw@redis:6379",
    "IMDEDUP_SCYLLA_PASSWORD": "pw",
    "REDIS_PASSWORD": "pw",
}

_help_cache = {}

# The internal TLS variables and the file `imdedup certs` writes for each.
TLS_FILES = {"IMDEDUP_TLS_CERT": "tls.crt", "IMDEDUP_TLS_KEY": "tls.key", "IMDEDUP_TLS_CA": "ca.crt"}
_certs = {}


def throwaway_certs(binary):
    """`imdedup certs --out DIR` once per run: DIR/<service>/{tls.crt,tls.key,ca.crt}."""
    if "dir" not in _certs:
        out = tempfile.mkdtemp(prefix="imdedup-check-certs-")
        atexit.register(shutil.rmtree, out, True)
        run = subprocess.run([binary, "certs", "--out", out], capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"check_config: `{binary} certs --out {out}` failed:\n{run.stderr}")
        _certs["dir"] = out
    return _certs["dir"]


def known_env(binary, subcommand):
    if subcommand not in _help_cache:
        out = subprocess.run([binary, subcommand, "--help"], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"check_config: `{binary} {subcommand} --help` failed:\n{out.stderr}")
        _help_cache[subcommand] = set(re.findall(r"\[env:\s*(IMDEDUP_[A-Z0-9_]+)", out.stdout))
    return _help_cache[subcommand]


def expand(value, env):
    """Kubernetes' $(VAR) expansion; $$ escapes, unknown references stay."""

    def repl(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", repl, value)


def pem_placeholder(scratch):
    """A self-signed CA certificate (PEM), made once, so a check that parses the
    CA file gets a real one. Falls back to a dummy PEM without openssl."""
    path = os.path.join(scratch, "placeholder-ca.pem")
    if not os.path.exists(path):
        key = os.path.join(scratch, "placeholder-ca.key")
        made = shutil.which("openssl") and subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=imdedup chart check", "-keyout", key, "-out", path],
            capture_output=True).returncode == 0
        if not made:
            with open(path, "w") as f:
                f.write("-----BEGIN CERTIFICATE-----\nMA==\n-----END CERTIFICATE-----\n")
    with open(path) as f:
        return f.read()


def pod_names(doc):
    name = doc["metadata"]["name"]
    if doc["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(int(doc["spec"].get("replicas", 1)))] or [f"{name}-0"]
    if doc["kind"] == "Job":
        return [f"{name}-x7k2p"]
    return [f"{name}-5d8f7c9b6-x7k2p"]


def field_value(path, pod, doc):
    return {
        "metadata.name": pod,
        "metadata.namespace": doc["metadata"].get("namespace", "default"),
        "status.podIP": "10.0.0.10",
        "status.hostIP": "10.0.0.1",
        "spec.nodeName": "node-1",
        "spec.serviceAccountName": "default",
    }.get(path, "placeholder")


CHART_CONTAINERS = {"gateway", "ingest", "storage", "migrate"}


def is_imdedup(doc, container):
    """The chart's own containers (by name, in a workload labelled part-of
    imdedup), or any container whose image or command is imdedup."""
    labels = doc["metadata"].get("labels") or {}
    if labels.get("app.kubernetes.io/part-of") == "imdedup" and container["name"] in CHART_CONTAINERS:
        return True
    image = container.get("image", "").split("@")[0]
    last = image.rsplit("/", 1)[-1].split(":")[0]
    command = container.get("command") or []
    return last == "imdedup" or bool(command and os.path.basename(command[0]) == "imdedup")


def build_env(container, pod, doc, configmaps, secrets, problems):
    env = {"HOSTNAME": pod}  # the kubelet sets it to the pod's name
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for key, kind, found in (("configMapRef", "ConfigMap", configmaps), ("secretRef", "Secret", secrets)):
            if key not in source:
                continue
            ref = source[key]
            data = found.get(ref["name"])
            if data is None:
                if not ref.get("optional"):
                    problems.append(f"envFrom {kind} {ref['name']} is not in the render")
                continue
            if kind == "ConfigMap":
                env.update({prefix + k: str(v) for k, v in data.items()})
            else:
                env.update({prefix + k: SECRET_PLACEHOLDERS.get(prefix + k, "placeholder") for k in data})
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var:
            env[name] = expand(str(var["value"]), env)
        elif "valueFrom" in var:
            source = var["valueFrom"]
            if "secretKeyRef" in source:
                env[name] = SECRET_PLACEHOLDERS.get(name, "placeholder")
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                data = configmaps.get(ref["name"], {})
                if ref["key"] in data:
                    env[name] = str(data[ref["key"]])
                elif not ref.get("optional"):
                    problems.append(f"{name}: ConfigMap {ref['name']} key {ref['key']} is not in the render")
            elif "fieldRef" in source:
                env[name] = field_value(source["fieldRef"]["fieldPath"], pod, doc)
            else:
                env[name] = "1"
        else:
            env[name] = ""
    return env


def relocate_mounts(env, container, pod_spec, scratch, configmaps, tls_dir=None):
    """Move env values that point into mounted volumes into the scratch dir,
    creating the files a Secret or ConfigMap volume would hold: a ConfigMap
    of the render with its real keys, the internal TLS files of a Secret
    volume from tls_dir (`imdedup certs` output for this service), anything
    else with a placeholder."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    for tmpl in pod_spec.get("_claims", []):
        volumes.setdefault(tmpl, {"name": tmpl, "persistentVolumeClaim": {}})
    mounts = sorted(container.get("volumeMounts") or [], key=lambda m: -len(m["mountPath"]))
    for mount in mounts:
        target = os.path.join(scratch, mount["mountPath"].lstrip("/"))
        os.makedirs(target, exist_ok=True)
        volume = volumes.get(mount["name"], {})
        rendered = configmaps.get((volume.get("configMap") or {}).get("name"))
        if rendered is not None and not volume["configMap"].get("items"):
            for key, content in rendered.items():
                with open(os.path.join(target, key), "w") as f:
                    f.write(content)
        for kind in ("secret", "configMap"):
            if kind in volume:
                for item in volume[kind].get("items") or []:
                    path = os.path.join(target, item["path"])
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "w") as f:
                        f.write(pem_placeholder(scratch))
    for name, value in env.items():
        for mount in mounts:
            mp = mount["mountPath"].rstrip("/")
            if value == mp or value.startswith(mp + "/"):
                moved = os.path.join(scratch, mp.lstrip("/")) + value[len(mp):]
                volume = volumes.get(mount["name"], {})
                if name in TLS_FILES and value != mp and "secret" in volume and tls_dir:
                    # a real certificate, key and CA: the binary loads them
                    os.makedirs(os.path.dirname(moved), exist_ok=True)
                    shutil.copyfile(os.path.join(tls_dir, TLS_FILES[name]), moved)
                elif value != mp and not os.path.exists(moved) and ("secret" in volume or "configMap" in volume):
                    # a whole Secret or ConfigMap mounted: its keys are not in the render
                    os.makedirs(os.path.dirname(moved), exist_ok=True)
                    with open(moved, "w") as f:
                        f.write(pem_placeholder(scratch))
                env[name] = moved
                break
    return env


def check_render(binary, path, results):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if isinstance(d, dict)]
    configmaps = {d["metadata"]["name"]: d.get("data") or {} for d in docs if d.get("kind") == "ConfigMap"}
    secrets = {}
    for d in docs:
        if d.get("kind") == "Secret":
            secrets[d["metadata"]["name"]] = {**(d.get("data") or {}), **(d.get("stringData") or {})}
    render = os.path.basename(path)
    for doc in docs:
        if doc.get("kind") not in WORKLOADS:
            continue
        pod_spec = doc["spec"]["template"]["spec"]
        pod_spec["_claims"] = [t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates") or []]
        for container in pod_spec.get("containers") or []:
            if not is_imdedup(doc, container):
                continue
            args = list(container.get("command") or [])[1:] + list(container.get("args") or [])
            subcommand = next((a for a in args if not a.startswith("-")), None)
            label = f"{render}: {doc['kind']}/{doc['metadata']['name']} container {container['name']}"
            if subcommand is None:
                results.append((False, label, "no subcommand in the container's args"))
                continue
            known = known_env(binary, subcommand)
            for pod in pod_names(doc):
                problems = []
                with tempfile.TemporaryDirectory(prefix="imdedup-check-") as scratch:
                    env = build_env(container, pod, doc, configmaps, secrets, problems)
                    unknown = sorted(n for n in env if n.startswith("IMDEDUP_") and n not in known)
                    if unknown:
                        problems.append(f"`imdedup {subcommand}` does not know {', '.join(unknown)}")
                    certs = throwaway_certs(binary)
                    tls_dir = os.path.join(certs, subcommand)
                    if not os.path.isdir(tls_dir):
                        tls_dir = os.path.join(certs, "storage")
                    env = relocate_mounts(env, container, pod_spec, scratch, configmaps, tls_dir)
                    run = subprocess.run([binary, "--check-config", *args], env=env, cwd=scratch,
                                         capture_output=True, text=True, timeout=60)
                    if run.returncode != 0:
                        problems.append(f"`imdedup --check-config {' '.join(args)}` exited {run.returncode}: "
                                        + (run.stderr.strip() or run.stdout.strip()))
                results.append((not problems, f"{label} (pod {pod})", "; ".join(problems)))
    check_internal_tls(docs, configmaps, secrets, render, results)


# The URL variables each chart container dials, and the server behind each.
# (Ingest gets IMDEDUP_SHARDS too, but only to know which conversations are
# its own: it dials none of them.)
DIALS = {
    "gateway": {"IMDEDUP_SHARDS": "ingest", "IMDEDUP_STORAGE_URL": "storage"},
    "ingest": {"IMDEDUP_STORAGE_URL": "storage"},
    "storage": {},
}


def dialled_hosts(component, env):
    """(server component, URL) for each gRPC URL the component dials."""
    out = []
    for name, server in DIALS[component].items():
        for entry in filter(None, (e.strip() for e in env.get(name, "").split(","))):
            out.append((server, entry.split("=", 1)[1] if "=" in entry.split("://")[0] else entry))
    return out


def name_matches(pattern, host):
    """A certificate DNS name (maybe `*.rest`, one label) against a host, as HTTPS does."""
    pattern, host = pattern.lower().rstrip("."), host.lower().rstrip(".")
    if pattern.startswith("*."):
        head, _, rest = host.partition(".")
        return bool(head) and rest == pattern[2:]
    return pattern == host


def check_internal_tls(docs, configmaps, secrets, render, results):
    """The internal TLS wiring of one render; see the module docstring."""
    chart = {}
    for doc in docs:
        if doc.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        labels = doc["metadata"].get("labels") or {}
        if labels.get("app.kubernetes.io/part-of") != "imdedup":
            continue
        pod_spec = doc["spec"]["template"]["spec"]
        for container in pod_spec.get("containers") or []:
            if container["name"] in ("gateway", "ingest", "storage"):
                env = build_env(container, pod_names(doc)[0], doc, configmaps, secrets, [])
                chart[container["name"]] = (env, container, pod_spec)
    if set(chart) != {"gateway", "ingest", "storage"}:
        return
    problems = []
    certificates = {d["spec"]["secretName"]: d["spec"] for d in docs
                    if d.get("kind") == "Certificate" and d.get("apiVersion", "").startswith("cert-manager.io/")}
    tls = {c: "IMDEDUP_TLS_CERT" in env for c, (env, _, _) in chart.items()}
    plain = {c: env.get("IMDEDUP_INSECURE_PLAINTEXT") == "true" for c, (env, _, _) in chart.items()}
    if not (all(tls.values()) or all(plain.values())) or any(tls[c] and plain[c] for c in chart):
        problems.append(f"mixed internal TLS: TLS {sorted(c for c in tls if tls[c])}, plaintext "
                        f"{sorted(c for c in plain if plain[c])}, neither {sorted(c for c in chart if not (tls[c] or plain[c]))}")
    scheme = "https://" if all(tls.values()) else "http://"
    for client, (env, _, _) in chart.items():
        for _, url in dialled_hosts(client, env):
            if not url.startswith(scheme):
                problems.append(f"{client} dials {url}, expected {scheme}")
    if all(tls.values()) and certificates:
        def cert_of(component):
            env, container, pod_spec = chart[component]
            directory = os.path.dirname(env["IMDEDUP_TLS_CERT"])
            mount = next((m for m in container.get("volumeMounts") or [] if m["mountPath"].rstrip("/") == directory), None)
            volume = next((v for v in pod_spec.get("volumes") or [] if mount and v["name"] == mount["name"]), {})
            secret = (volume.get("secret") or {}).get("secretName")
            if mount is None or secret is None:
                problems.append(f"{component}: no Secret volume mounted at {directory}")
                return None
            if mount.get("subPath"):
                problems.append(f"{component}: the TLS Secret is mounted with subPath (renewals would not reach it)")
            if secret not in certificates:
                problems.append(f"{component}: its Secret {secret} is issued by no Certificate of the render")
                return None
            return certificates[secret]
        certs = {c: cert_of(c) for c in chart}
        issuers = {json_key(cert["issuerRef"]) for cert in certs.values() if cert}
        if len(issuers) > 1:
            problems.append(f"the certificates have different issuers: {sorted(issuers)}")
        callers = {}
        for client, (env, _, _) in chart.items():
            for server, url in dialled_hosts(client, env):
                callers.setdefault(server, set()).add(client)
                host = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0]
                server_cert, client_cert = certs.get(server), certs.get(client)
                if server_cert and not any(name_matches(n, host) for n in server_cert.get("dnsNames") or []):
                    problems.append(f"{client} dials {host}, which {server}'s certificate {server_cert.get('dnsNames')} does not cover")
                if server_cert and "server auth" not in (server_cert.get("usages") or []):
                    problems.append(f"{server}'s certificate lacks the `server auth` usage")
                if client_cert and "client auth" not in (client_cert.get("usages") or []):
                    problems.append(f"{client}'s certificate lacks the `client auth` usage")
        for server, clients in callers.items():
            allowed = [n for n in chart[server][0].get("IMDEDUP_TLS_ALLOW_CLIENTS", "").split(",") if n]
            for client in sorted(clients):
                names = (certs.get(client) or {}).get("dnsNames") or []
                if certs.get(client) and not any(name_matches(n, a) for n in names for a in allowed):
                    problems.append(f"{server} allows {allowed}, none of which {client}'s certificate {names} carries")
    mode = ("plaintext" if all(plain.values()) else
            "mixed" if not all(tls.values()) else
            "cert-manager certificates" if certificates else "existing Secrets, names not checked")
    results.append((not problems, f"{render}: internal TLS ({mode})", "; ".join(dict.fromkeys(problems))))


def json_key(value):
    return ",".join(f"{k}={value[k]}" for k in sorted(value))


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    binary = os.path.abspath(sys.argv[1])
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"check_config: {binary} is not an executable (build it: cargo build -p imdedup)")
    results = []
    for path in sys.argv[2:]:
        check_render(binary, path, results)
    for ok, label, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} binary check {label}" + ("" if ok else f"\n     {detail}"))
    passed = sum(1 for ok, _, _ in results if ok)
    failed = len(results) - passed
    print(f"checks: {passed} passed, {failed} failed")
    sys.exit(1 if failed or not results else 0)


if __name__ == "__main__":
    main()
