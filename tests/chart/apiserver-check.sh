#!/usr/bin/env bash
# Checks the Helm chart against a REAL kube-apiserver (plus etcd) running on loopback.
#
#   tests/chart/apiserver-check.sh [CHART_DIR]        (default: k8s/imdedup)
#
# Steps, one PASS/FAIL line each (exit status 1 if any FAIL):
#   etcd + kube-apiserver start (temp dir, free loopback ports, RBAC, static-token admin user,
#   a kubeconfig written to the temp dir), readiness; prometheus-operator CRDs (ServiceMonitor,
#   PrometheusRule, PodMonitor) and cert-manager CRDs (Certificate, Issuer, ClusterIssuer: the
#   chart's internal TLS) applied with `kubectl apply --server-side`; a namespace;
#   `helm template` of the chart with default values and with each ci/*.yaml, each sent through
#   `kubectl apply --dry-run=server --validate=strict` (the server's schema rejects unknown and
#   duplicate fields, wrong types, invalid names, ...); then helm install, helm upgrade with a
#   changed value (checked with kubectl jsonpath), helm rollback to revision 1 (checked to revert),
#   helm history with 3 revisions.
#
# Helm hooks: nothing runs pods here (no controller-manager, scheduler, kubelet), so a hook Job
# (the schema migration, pre-install/pre-upgrade) would never complete and helm would wait for it
# until --timeout. Default HOOK_MODE=simulate: helm runs WITH hooks; the hook Job is really
# created by the API server (so its manifest and the hook ordering are exercised), and this script
# plays the Job controller: it marks each helm hook Job Complete through the status subresource,
# then helm goes on (and applies the hook-delete-policy). HOOK_MODE=skip uses --no-hooks instead.
#
# Env knobs:
#   NAMESPACE (imdedup), RELEASE (imdedup), INSTALL_VALUES (values files for install; default: the first
#     of default/ci values whose render has a helm hook), KEEP_TMP=1 (keep temp dir + servers' logs),
#   UPGRADE_SET (gateway.replicas=3,config.logLevel=debug): the --set for the upgrade step,
#   CHECKSUM_PATH (the checked object's pod-template annotation checksum/config): must change on upgrade,
#   UPGRADE_CHECK ("deployment -l app.kubernetes.io/component=gateway {.items[0].spec.replicas} 3"):
#     kind, selector, jsonpath and expected value after upgrade (and != before),
#   KUBE_VERSION / IMDEDUP_KUBE_CACHE (see kube/build.sh), HELM_VERSION (v3.22.0),
#   PROM_OPERATOR_VERSION (v0.94.1), CERT_MANAGER_VERSION (v1.21.2), HOOK_MODE (simulate|skip),
#   HOOK_TIMEOUT (2m).
#
# No cert-manager controller runs here: the Certificates and Issuers are validated and stored, never
# issued (so the pods could not start anyway; none does here).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CHART="$(cd "${1:-$REPO/k8s/imdedup}" 2>/dev/null && pwd || echo "${1:-$REPO/k8s/imdedup}")"
NAMESPACE="${NAMESPACE:-imdedup}"
RELEASE="${RELEASE:-imdedup}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
PROM_OPERATOR_VERSION="${PROM_OPERATOR_VERSION:-v0.94.1}"
PROM_CRDS="${PROM_CRDS:-servicemonitors prometheusrules podmonitors}"
CERT_MANAGER_VERSION="${CERT_MANAGER_VERSION:-v1.21.2}"
CERT_MANAGER_CRDS="${CERT_MANAGER_CRDS:-certificates issuers clusterissuers}"
HOOK_MODE="${HOOK_MODE:-simulate}"
HOOK_TIMEOUT="${HOOK_TIMEOUT:-2m}"
UPGRADE_SET="${UPGRADE_SET:-gateway.replicas=3,config.logLevel=debug}"
DEFAULT_CHECKSUM_PATH='{.items[0].spec.template.metadata.annotations.checksum/config}'
CHECKSUM_PATH="${CHECKSUM_PATH:-$DEFAULT_CHECKSUM_PATH}"
DEFAULT_UPGRADE_CHECK='deployment -l app.kubernetes.io/component=gateway {.items[0].spec.replicas} 3'
UPGRADE_CHECK="${UPGRADE_CHECK:-$DEFAULT_UPGRADE_CHECK}"

FAILED=0; PASSED=0
pass() { PASSED=$((PASSED+1)); printf 'PASS  %s\n' "$1"; }
fail() { FAILED=$((FAILED+1)); printf 'FAIL  %s\n' "$1"; [ -z "${2:-}" ] || sed 's/^/      | /' "$2" | tail -n "${FAIL_LINES:-40}"; }
info() { printf 'INFO  %s\n' "$*"; }
die()  { fail "$1" "${2:-}"; summary; exit 1; }
summary() { printf 'apiserver-check: %d passed, %d failed (chart %s)\n' "$PASSED" "$FAILED" "$CHART"; }

# step NAME CMD... : runs CMD, output to a log; PASS/FAIL line; returns CMD's status
STEP_N=0
step() {
  local name="$1"; shift
  STEP_N=$((STEP_N+1)); local out="$WORK/logs/step-$STEP_N.log"
  if "$@" >"$out" 2>&1; then pass "$name"; warnings "$out"; return 0
  else fail "$name" "$out"; return 1; fi
}
warnings() { grep -h '^Warning:' "$1" 2>/dev/null | sort -u | sed 's/^/WARN  /' || true; }

WORK="$(mktemp -d /tmp/imdedup-apiserver-check.XXXXXX)"
mkdir -p "$WORK/logs" "$WORK/etcd" "$WORK/certs" "$WORK/helm/cache" "$WORK/helm/config" "$WORK/helm/data"
ETCD_PID=""; APISERVER_PID=""; COMPLETER_PID=""

stop_pid() { # pid, name, seconds before KILL
  local pid="$1" i
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < ${3:-15} * 10; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then echo "($2 did not stop on TERM, killing)" >&2; kill -KILL "$pid" 2>/dev/null; fi
  wait "$pid" 2>/dev/null || true
}
cleanup() {
  local rc=$?
  stop_pid "$COMPLETER_PID" hook-completer 2
  stop_pid "$APISERVER_PID" kube-apiserver 20   # the apiserver first: it hangs if etcd goes first
  stop_pid "$ETCD_PID" etcd 10
  if [ "${KEEP_TMP:-0}" = 1 ]; then echo "kept $WORK (kubeconfig: $WORK/kubeconfig)" >&2; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

# --- tools -----------------------------------------------------------------------------------------
KBIN="$("$REPO/tests/kube/build.sh" kube-apiserver kubectl 2>"$WORK/logs/build.log" | tail -n1)"
[ -x "$KBIN/kube-apiserver" ] && [ -x "$KBIN/kubectl" ] || die "kube binaries (tests/kube/build.sh)" "$WORK/logs/build.log"
KUBECTL="$KBIN/kubectl"
if command -v helm >/dev/null 2>&1; then HELM="$(command -v helm)"
elif [ -x "$(go env GOPATH 2>/dev/null)/bin/helm" ]; then HELM="$(go env GOPATH)/bin/helm"
else
  info "installing helm $HELM_VERSION with go install (a few minutes)"
  go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >"$WORK/logs/helm-install.log" 2>&1 \
    || die "helm install (go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION)" "$WORK/logs/helm-install.log"
  HELM="$(go env GOPATH)/bin/helm"
fi
command -v etcd >/dev/null 2>&1 || die "etcd in PATH (tests/kube/build.sh installs etcd-server)"
[ -f "$CHART/Chart.yaml" ] || die "chart at $CHART (no Chart.yaml)"
export HELM_CACHE_HOME="$WORK/helm/cache" HELM_CONFIG_HOME="$WORK/helm/config" HELM_DATA_HOME="$WORK/helm/data"
info "kubectl $("$KUBECTL" version --client -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])'), $("$HELM" version --short), $(etcd --version | head -1), work dir $WORK"

# --- etcd -------------------------------------------------------------------------------------------
ETCD_CLIENT_PORT="$(free_port)"; ETCD_PEER_PORT="$(free_port)"; APISERVER_PORT="$(free_port)"
etcd --name default --data-dir "$WORK/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "default=http://127.0.0.1:$ETCD_PEER_PORT" --listen-metrics-urls "" \
  >"$WORK/logs/etcd.log" 2>&1 &
ETCD_PID=$!
etcd_ready() { local i; for ((i = 0; i < 100; i++)); do
  curl -fsS "http://127.0.0.1:$ETCD_CLIENT_PORT/health" 2>/dev/null | grep -q '"health":"true"' && return 0
  kill -0 "$ETCD_PID" 2>/dev/null || return 1; sleep 0.2; done; return 1; }
if etcd_ready; then pass "etcd started on 127.0.0.1:$ETCD_CLIENT_PORT"; else die "etcd start" "$WORK/logs/etcd.log"; fi

# --- kube-apiserver ----------------------------------------------------------------------------------
openssl genrsa -out "$WORK/certs/sa.key" 2048 >/dev/null 2>&1 && openssl rsa -in "$WORK/certs/sa.key" -pubout -out "$WORK/certs/sa.pub" >/dev/null 2>&1 \
  || die "service-account key pair (openssl)"
TOKEN="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
echo "$TOKEN,admin,admin-uid,system:masters" > "$WORK/certs/tokens.csv"
"$KBIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$APISERVER_PORT" \
  --endpoint-reconciler-type=none \
  --cert-dir="$WORK/certs" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$WORK/certs/sa.pub" --service-account-signing-key-file="$WORK/certs/sa.key" \
  --service-cluster-ip-range=10.96.0.0/16 \
  --token-auth-file="$WORK/certs/tokens.csv" --authorization-mode=RBAC \
  --allow-privileged=true --profiling=false \
  >"$WORK/logs/kube-apiserver.log" 2>&1 &
APISERVER_PID=$!

# The self-signed serving cert the apiserver writes to --cert-dir is a chain ending in its own CA.
export KUBECONFIG="$WORK/kubeconfig"
write_kubeconfig() {
  local tls
  if [ -s "$WORK/certs/apiserver.crt" ]; then tls="certificate-authority: $WORK/certs/apiserver.crt"; else tls="insecure-skip-tls-verify: true"; fi
  cat >"$KUBECONFIG" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    $tls
users:
- name: admin
  user:
    token: $TOKEN
contexts:
- name: local
  context: {cluster: local, user: admin, namespace: $NAMESPACE}
current-context: local
EOF
}
apiserver_ready() { local i; for ((i = 0; i < 240; i++)); do
  kill -0 "$APISERVER_PID" 2>/dev/null || return 1
  if [ -s "$WORK/certs/apiserver.crt" ]; then
    write_kubeconfig
    "$KUBECTL" get --raw /readyz >"$WORK/logs/readyz.log" 2>&1 && return 0
  fi
  sleep 0.5; done; return 1; }
t0=$(date +%s)
if apiserver_ready; then
  pass "kube-apiserver ready on https://127.0.0.1:$APISERVER_PORT in $(( $(date +%s) - t0 ))s ($("$KUBECTL" version -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["serverVersion"]["gitVersion"])' 2>/dev/null))"
else
  cat "$WORK/logs/readyz.log" >>"$WORK/logs/kube-apiserver.log" 2>/dev/null; die "kube-apiserver readiness" "$WORK/logs/kube-apiserver.log"
fi
step "RBAC: static-token user is cluster admin (kubectl auth can-i '*' '*')" \
  bash -c '[ "$("$0" auth can-i "*" "*" --all-namespaces)" = yes ]' "$KUBECTL"

# --- CRDs ------------------------------------------------------------------------------------------------
crd_dir_of() {
  local dir
  dir="$(cd /tmp && go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROM_OPERATOR_VERSION" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin).get("Dir",""))')" || return 1
  [ -d "$dir/example/prometheus-operator-crd" ] && echo "$dir/example/prometheus-operator-crd"
}
apply_crds() {
  local dir files=() c
  dir="$(crd_dir_of)" || { echo "go mod download of prometheus-operator@$PROM_OPERATOR_VERSION failed"; return 1; }
  for c in $PROM_CRDS; do files+=(-f "$dir/monitoring.coreos.com_$c.yaml"); done
  "$KUBECTL" apply --server-side --field-manager=apiserver-check "${files[@]}" || return 1
  for c in $PROM_CRDS; do
    "$KUBECTL" wait --for condition=established --timeout=60s "crd/$c.monitoring.coreos.com" || return 1
  done
}
step "prometheus-operator $PROM_OPERATOR_VERSION CRDs ($PROM_CRDS) applied --server-side and established" apply_crds \
  || die "cannot validate monitoring objects without the CRDs"
# cert-manager's CRDs as controller-gen writes them (deploy/crds/ of its module: the same schemas
# as its Helm chart's templated copies, without the template lines).
apply_cert_manager_crds() {
  local dir files=() c
  dir="$(cd /tmp && go mod download -json "github.com/cert-manager/cert-manager@$CERT_MANAGER_VERSION" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin).get("Dir",""))')" \
    || { echo "go mod download of cert-manager@$CERT_MANAGER_VERSION failed"; return 1; }
  for c in $CERT_MANAGER_CRDS; do files+=(-f "$dir/deploy/crds/cert-manager.io_$c.yaml"); done
  "$KUBECTL" apply --server-side --field-manager=apiserver-check "${files[@]}" || return 1
  for c in $CERT_MANAGER_CRDS; do
    "$KUBECTL" wait --for condition=established --timeout=60s "crd/$c.cert-manager.io" || return 1
  done
}
step "cert-manager $CERT_MANAGER_VERSION CRDs ($CERT_MANAGER_CRDS) applied --server-side and established" apply_cert_manager_crds \
  || die "cannot validate the internal TLS objects without the CRDs"
step "namespace $NAMESPACE created" "$KUBECTL" create namespace "$NAMESPACE" || die "namespace"

# --- server-side validation of renders -------------------------------------------------------------------
SERVER_VERSION="$("$KUBECTL" version -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["serverVersion"]["gitVersion"])' 2>/dev/null || echo)"
# helm template does not ask the cluster for capabilities: tell it what the cluster has
API_VERSION_ARGS=(--api-versions monitoring.coreos.com/v1 --api-versions monitoring.coreos.com/v1/ServiceMonitor
                  --api-versions monitoring.coreos.com/v1/PrometheusRule --api-versions monitoring.coreos.com/v1/PodMonitor
                  --api-versions cert-manager.io/v1 --api-versions cert-manager.io/v1/Certificate
                  --api-versions cert-manager.io/v1/Issuer)
[ -z "$SERVER_VERSION" ] || API_VERSION_ARGS+=(--kube-version "$SERVER_VERSION")

if grep -qE '^dependencies:' "$CHART/Chart.yaml" && [ ! -d "$CHART/charts" ]; then
  info "Chart.yaml lists dependencies and charts/ is missing: helm will fail (no chart repositories reachable here)"
fi

to_file() { local f="$1"; shift; "$@" >"$f"; }
validate_render() { # label, extra helm args...
  local label="$1"; shift
  local render="$WORK/render-$(echo "$label" | tr -c 'A-Za-z0-9._-' _).yaml"
  step "helm template ($label)" to_file "$render" "$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" "${API_VERSION_ARGS[@]}" "$@" \
    || return 1
  local kinds; kinds="$(grep -hE '^kind: ' "$render" | sort | uniq -c | awk '{printf "%s%s x%s", sep, $3, $1; sep=", "}')"
  info "render ($label): ${kinds:-no objects}"
  # objects the chart puts into other namespaces (e.g. a ServiceMonitor in `monitoring`): create those
  local ns
  for ns in $(render_namespaces "$render"); do
    [ "$ns" = "$NAMESPACE" ] && continue
    "$KUBECTL" get namespace "$ns" >/dev/null 2>&1 && continue
    "$KUBECTL" create namespace "$ns" >/dev/null 2>&1 && info "created namespace $ns (used by the render)"
  done
  # no --namespace: objects without one go to the kubeconfig context's namespace ($NAMESPACE)
  step "kubectl apply --dry-run=server --validate=strict ($label)" \
    "$KUBECTL" apply --dry-run=server --validate=strict -f "$render"
  # candidate for install: renders a helm hook and no HPA (an HPA owns the replicas the upgrade changes)
  if grep -q 'helm.sh/hook' "$render" && ! grep -q '^kind: HorizontalPodAutoscaler' "$render" && [ -z "$HOOK_VALUES_LABEL" ]; then
    HOOK_VALUES_LABEL="$label"; HOOK_VALUES_ARGS=("$@")
  fi
}
render_namespaces() {
  python3 - "$1" <<'PY'
import sys, yaml
ns = set()
for d in yaml.safe_load_all(open(sys.argv[1])):
    if isinstance(d, dict):
        n = (d.get("metadata") or {}).get("namespace")
        if n: ns.add(n)
print(" ".join(sorted(ns)))
PY
}
HOOK_VALUES_LABEL=""; HOOK_VALUES_ARGS=()
validate_render "default values"
if [ -d "$CHART/ci" ]; then
  for f in "$CHART"/ci/*.yaml "$CHART"/ci/*.yml; do
    [ -f "$f" ] || continue
    validate_render "ci/$(basename "$f")" -f "$f"
  done
else
  info "no $CHART/ci directory: only default values validated"
fi

# --- helm install / upgrade / rollback -----------------------------------------------------------------------
# Plays the Job controller for helm hook Jobs (see the header): status -> Complete.
complete_hook_jobs() {
  local now name hook completions body
  while true; do
    "$KUBECTL" get jobs -n "$NAMESPACE" -o jsonpath='{range .items[*]}{.metadata.name}{"\t"}{.metadata.annotations.helm\.sh/hook}{"\t"}{.spec.completions}{"\t"}{.status.conditions[*].type}{"\n"}{end}' 2>/dev/null \
    | while IFS=$'\t' read -r name hook completions conds; do
        [ -n "$hook" ] || continue
        case " $conds " in *" Complete "*|*" Failed "*) continue ;; esac
        now="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
        body="{\"status\":{\"startTime\":\"$now\",\"completionTime\":\"$now\",\"succeeded\":${completions:-1},\"active\":0,\"ready\":0,\"terminating\":0,
               \"conditions\":[{\"type\":\"SuccessCriteriaMet\",\"status\":\"True\",\"reason\":\"CompletionsReached\",\"message\":\"simulated by apiserver-check\",\"lastProbeTime\":\"$now\",\"lastTransitionTime\":\"$now\"},
                               {\"type\":\"Complete\",\"status\":\"True\",\"reason\":\"CompletionsReached\",\"message\":\"simulated by apiserver-check\",\"lastProbeTime\":\"$now\",\"lastTransitionTime\":\"$now\"}]}}"
        if "$KUBECTL" patch job "$name" -n "$NAMESPACE" --subresource=status --type=merge -p "$body" >/dev/null 2>>"$WORK/logs/hook-completer.err"; then
          echo "$(date -u +%T) marked hook Job $name ($hook) Complete" >>"$WORK/logs/hook-completer.log"
        fi
      done
    sleep 0.5
  done
}
# values for install/upgrade/rollback: INSTALL_VALUES (files, space-separated) if set, else the first
# of the validated value sets whose render has a helm hook (so the hook path is exercised), else defaults
INSTALL_ARGS=()
if [ -n "${INSTALL_VALUES:-}" ]; then
  for f in $INSTALL_VALUES; do INSTALL_ARGS+=(-f "$f"); done; INSTALL_LABEL="$INSTALL_VALUES"
elif [ -n "$HOOK_VALUES_LABEL" ]; then
  INSTALL_ARGS=("${HOOK_VALUES_ARGS[@]}"); INSTALL_LABEL="$HOOK_VALUES_LABEL (first value set with a helm hook and no HPA)"
else
  INSTALL_LABEL="default values (no value set renders a helm hook)"
fi
info "install/upgrade/rollback with: $INSTALL_LABEL"
: >"$WORK/logs/hook-completer.log"; : >"$WORK/logs/hook-completer.err"
HELM_HOOK_ARGS=()
case "$HOOK_MODE" in
  simulate) complete_hook_jobs & COMPLETER_PID=$!; HELM_HOOK_ARGS=(--timeout "$HOOK_TIMEOUT")
            info "hooks: run for real; hook Jobs are marked Complete by this script (no Job controller/kubelet here)" ;;
  skip)     HELM_HOOK_ARGS=(--no-hooks); info "hooks: skipped (--no-hooks)" ;;
  *) die "HOOK_MODE must be simulate or skip, not $HOOK_MODE" ;;
esac
hook_report() {
  [ "$HOOK_MODE" = simulate ] || return 0
  local new; new="$(sed -n "$((${HOOK_SEEN:-0}+1)),\$p" "$WORK/logs/hook-completer.log" 2>/dev/null)"
  HOOK_SEEN="$(wc -l <"$WORK/logs/hook-completer.log" 2>/dev/null || echo 0)"
  if [ -n "$new" ]; then echo "$new" | sed 's/^/INFO    /'; else info "  (no hook Job in this step)"; fi
  if [ -s "$WORK/logs/hook-completer.err" ]; then sed 's/^/WARN    hook-completer: /' "$WORK/logs/hook-completer.err" | sort -u | tail -5; : >"$WORK/logs/hook-completer.err"; fi
}

read -r CHECK_KIND CHECK_SEL_FLAG CHECK_SEL CHECK_PATH CHECK_WANT <<<"$UPGRADE_CHECK"
observe_path() { "$KUBECTL" get "$CHECK_KIND" -n "$NAMESPACE" "$CHECK_SEL_FLAG" "$CHECK_SEL" -o "jsonpath=$1" 2>&1; }
observe() { observe_path "$CHECK_PATH"; }
# a release-wide fingerprint: every workload's replicas + pod-template annotations (config checksums)
# and every ConfigMap's data, to check that a rollback really restores revision 1
fingerprint() {
  { "$KUBECTL" get deployments,statefulsets,daemonsets -n "$NAMESPACE" -o jsonpath='{range .items[*]}{.kind}/{.metadata.name} replicas={.spec.replicas} {.spec.template.metadata.annotations}{"\n"}{end}'
    "$KUBECTL" get configmaps -n "$NAMESPACE" -l "app.kubernetes.io/instance=$RELEASE" -o jsonpath='{range .items[*]}ConfigMap/{.metadata.name} {.data}{"\n"}{end}'
  } 2>&1 | sort
}

step "helm install $RELEASE ($INSTALL_LABEL; no --wait)" "$HELM" install "$RELEASE" "$CHART" -n "$NAMESPACE" "${INSTALL_ARGS[@]}" "${HELM_HOOK_ARGS[@]}"
INSTALL_OK=$?
hook_report
if [ "$INSTALL_OK" = 0 ]; then
  step "release resources exist on the server (helm get manifest | kubectl get -f -)" \
    bash -c '"$1" get manifest "$2" -n "$3" | "$4" get -f - -o name' _ "$HELM" "$RELEASE" "$NAMESPACE" "$KUBECTL"
  BEFORE="$(observe)"; FP1="$(fingerprint)"; SUM1="$(observe_path "$CHECKSUM_PATH")"
  info "before upgrade: $CHECK_KIND $CHECK_SEL $CHECK_PATH = '$BEFORE'"
  if step "helm upgrade $RELEASE --reuse-values --set $UPGRADE_SET" "$HELM" upgrade "$RELEASE" "$CHART" -n "$NAMESPACE" --reuse-values --set "$UPGRADE_SET" "${HELM_HOOK_ARGS[@]}"; then
    hook_report
    AFTER="$(observe)"; FP2="$(fingerprint)"; SUM2="$(observe_path "$CHECKSUM_PATH")"
    out="$WORK/logs/upgrade-check.log"; printf 'before: %s\nafter:  %s\nwant:   %s\n' "$BEFORE" "$AFTER" "$CHECK_WANT" >"$out"
    if [ "$AFTER" = "$CHECK_WANT" ] && [ "$AFTER" != "$BEFORE" ]; then pass "upgrade took: $CHECK_KIND $CHECK_SEL $CHECK_PATH '$BEFORE' -> '$AFTER'"
    else fail "upgrade took: $CHECK_KIND $CHECK_SEL $CHECK_PATH (want '$CHECK_WANT', was '$BEFORE')" "$out"; fi
    if [ -z "$SUM1$SUM2" ]; then info "no pod-template annotation at $CHECKSUM_PATH: config-change rollout not checked"
    elif [ -n "$SUM2" ] && [ "$SUM1" != "$SUM2" ]; then pass "config change rolls the pods: $CHECKSUM_PATH ${SUM1:0:12}… -> ${SUM2:0:12}…"
    else printf 'before: %s\nafter:  %s\n' "$SUM1" "$SUM2" >"$WORK/logs/checksum.log"; fail "config change rolls the pods: $CHECKSUM_PATH unchanged" "$WORK/logs/checksum.log"; fi
    diff <(echo "$FP1") <(echo "$FP2") | grep '^[<>].*replicas=' | sed 's/^/INFO    changed by upgrade: /' | cut -c1-160
  else hook_report; fi
  if step "helm rollback $RELEASE 1" "$HELM" rollback "$RELEASE" 1 -n "$NAMESPACE" --timeout "$HOOK_TIMEOUT" $([ "$HOOK_MODE" = skip ] && echo --no-hooks); then
    hook_report
    BACK="$(observe)"; FP3="$(fingerprint)"
    out="$WORK/logs/rollback-check.log"; { printf 'revision 1: %s\nrolled back: %s\n' "$BEFORE" "$BACK"; diff <(echo "$FP1") <(echo "$FP3"); } >"$out"
    if [ "$BACK" = "$BEFORE" ] && [ "$FP1" = "$FP3" ] && [ "$(observe_path "$CHECKSUM_PATH")" = "$SUM1" ]; then pass "rollback reverted: $CHECK_PATH back to '$BACK', workloads and ConfigMaps identical to revision 1"
    else fail "rollback reverted to revision 1" "$out"; fi
  fi
  hist="$WORK/logs/history.log"
  "$HELM" history "$RELEASE" -n "$NAMESPACE" -o json >"$hist" 2>&1
  summary_hist="$(python3 -c 'import json,sys; h=json.load(open(sys.argv[1])); print(" ".join("%s:%s"%(r["revision"],r["status"]) for r in h))' "$hist" 2>/dev/null)"
  if [ "$summary_hist" = "1:superseded 2:superseded 3:deployed" ]; then pass "helm history: 3 revisions ($summary_hist)"
  else "$HELM" history "$RELEASE" -n "$NAMESPACE" >>"$hist" 2>&1; fail "helm history: 3 revisions (got: ${summary_hist:-?})" "$hist"; fi
  step "helm uninstall $RELEASE" "$HELM" uninstall "$RELEASE" -n "$NAMESPACE" --timeout "$HOOK_TIMEOUT"
fi

if ! kill -0 "$APISERVER_PID" 2>/dev/null; then fail "kube-apiserver still running at the end" "$WORK/logs/kube-apiserver.log"; fi
summary
[ "$FAILED" = 0 ]
