#!/usr/bin/env bash
# The Helm chart's offline checks (part of tests/run.sh):
#
#   - helm lint --strict with the default values, each k8s/imdedup/ci/*.yaml
#     and each k8s/examples/imdedup-*.yaml
#   - helm template of each of them, every render validated by kubeconform
#     -strict against the offline Kubernetes schemas (the chart's minimum and
#     the newest version) and the CRD schemas (prometheus-operator's
#     ServiceMonitor/PrometheusRule, cert-manager's Certificate/Issuer)
#   - helm package: the packaged chart carries the real dashboard and rules of
#     deploy/ (the symlinks in files/ are followed) and renders the same
#   - the README's parameter tables are what readme-generator makes of
#     values.yaml
#   - helm-unittest suites in k8s/imdedup/tests/
#   - checksums (tests/chart/checksums.py): a configuration change moves the
#     checksum annotations of exactly the pods it concerns
#   - the binary check (tests/chart/check_config.py): every rendered imdedup
#     container's args and environment are accepted by the real binary
#     (`imdedup --check-config ...`, with real throwaway TLS files in the
#     Secret-mounted TLS directories), every IMDEDUP_* variable it sets is
#     one the binary knows, and each render's internal TLS wiring holds
#     (certificate names cover the hosts dialled and the allowed callers)
#
# Tools come from tests/chart/tools.sh (installed into ~/.cache/imdedup/tools
# the first time). The binary is ${IMDEDUP_BIN:-target/debug/imdedup}; build
# it first (cargo build -p imdedup; tests/run.sh has).
#
# Usage: tests/chart/chart-test.sh [--keep]   (--keep: keep the renders and print where)
# Prints `chart: N passed, M failed` last; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

keep=0
for a in "$@"; do
  case "$a" in
    --keep) keep=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "chart-test: unknown argument $a" >&2; exit 2 ;;
  esac
done

CHART=k8s/imdedup
RELEASE=imdedup
NAMESPACE=imdedup
IMDEDUP_BIN="${IMDEDUP_BIN:-target/debug/imdedup}"
# The chart's minimum Kubernetes version and the newest the schemas know.
K8S_VERSIONS="v1.30.0 v1.37.0"

TOOLS="$(tests/chart/tools.sh | tail -n 1)"
BIN="$TOOLS/bin"
PY="$TOOLS/venv/bin/python"

work="$(mktemp -d "${TMPDIR:-/tmp}/imdedup-chart-test.XXXXXX")"
if [ "$keep" = 1 ]; then
  echo "chart-test: renders kept in $work"
else
  trap 'rm -rf "$work"' EXIT
fi

passed=0
failed=0
# check NAME COMMAND...: run it, count it, show its output only on failure.
check() {
  local name="$1"
  shift
  if "$@" >"$work/log" 2>&1; then
    passed=$((passed + 1))
    echo "ok   $name"
  else
    failed=$((failed + 1))
    echo "FAIL $name"
    # helm warns about the chart's symlinks on every load; they are intended.
    grep -v 'found symbolic link in path' "$work/log" | sed 's/^/     /' | head -n 60
  fi
}
# Add a sub-runner's counts to the totals: the last line of LOG starting with
# PREFIX, read for "N passed" and "N failed" (either may be missing: 0).
add_counts() { # log prefix
  local line p f
  line="$(grep -E "^\s*$2" "$1" | tail -n 1 || true)"
  if [ -z "$line" ]; then
    failed=$((failed + 1)) # the runner did not get to counting
    return
  fi
  p="$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || echo 0)"
  f="$(grep -oE '[0-9]+ failed' <<<"$line" | grep -oE '[0-9]+' || echo 0)"
  passed=$((passed + p))
  failed=$((failed + f))
}

helm() { "$BIN/helm" "$@"; }

# --- the values files: the defaults, ci/ and the examples ---------------------------------------
values_files=("")
for f in "$CHART"/ci/*.yaml k8s/examples/imdedup-*.yaml; do
  [ -e "$f" ] && values_files+=("$f")
done
name_of() { if [ -z "$1" ]; then echo default; else echo "$(basename "$(dirname "$1")")-$(basename "$1" .yaml)"; fi; }

renders=()
for f in "${values_files[@]}"; do
  n="$(name_of "$f")"
  args=()
  [ -n "$f" ] && args=(-f "$f")
  check "helm lint --strict ($n)" helm lint --strict "$CHART" "${args[@]}"
  check "helm template ($n)" sh -c '"$@" > "'"$work/$n.yaml"'"' _ \
    "$BIN/helm" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" "${args[@]}"
  [ -s "$work/$n.yaml" ] && renders+=("$work/$n.yaml")
done

# --- kubeconform -strict on every render -------------------------------------------------------
# One process per Kubernetes version over every render, with one worker: the
# schemas share a 1.5 MB _definitions.json that each worker would compile anew.
kubeconform_all() { # version, renders...
  local v="$1"
  shift
  "$BIN/kubeconform" -strict -summary -n 1 \
    -schema-location "$TOOLS/schemas/k8s/$v-standalone-strict/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
    -schema-location "$TOOLS/schemas/crds/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json" \
    "$@"
}
for v in $K8S_VERSIONS; do
  check "kubeconform -strict $v, Kubernetes and CRD schemas (${#renders[@]} renders)" kubeconform_all "$v" "${renders[@]}"
done
# The ScyllaCluster example: its ConfigMap (the operator's CRD schema is not available offline).
check "kubeconform -strict (examples-scylla-cluster, ScyllaCluster skipped)" \
  "$BIN/kubeconform" -strict -summary -n 1 -skip ScyllaCluster \
  -schema-location "$TOOLS/schemas/k8s/${K8S_VERSIONS##* }-standalone-strict/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
  k8s/examples/scylla-cluster.yaml

# --- helm package: one source for the dashboard and the rules ----------------------------------
package_check() {
  local tgz
  helm package "$CHART" --destination "$work/package" >/dev/null
  tgz="$(ls "$work"/package/imdedup-*.tgz)"
  mkdir -p "$work/package/x"
  tar -xzf "$tgz" -C "$work/package/x"
  # the packaged files are the real ones from deploy/, not links
  [ ! -L "$work/package/x/imdedup/files/imdedup-dashboard.json" ]
  cmp deploy/grafana/imdedup-dashboard.json "$work/package/x/imdedup/files/imdedup-dashboard.json"
  cmp deploy/prometheus/imdedup-rules.yaml "$work/package/x/imdedup/files/imdedup-rules.yaml"
  # the package renders exactly as the folder does
  helm template "$RELEASE" "$tgz" --namespace "$NAMESPACE" -f "$CHART/ci/everything-on-values.yaml" >"$work/package/render.yaml"
  helm template "$RELEASE" "$CHART" --namespace "$NAMESPACE" -f "$CHART/ci/everything-on-values.yaml" >"$work/package/render-dir.yaml"
  # (the generated token secret differs between renders; everything-on sets one)
  diff "$work/package/render-dir.yaml" "$work/package/render.yaml"
  grep -q 'alert: ImdedupWindowBypassed' "$work/package/render.yaml"
  grep -q '"uid": "imdedup-send-path"' "$work/package/render.yaml"
}
check "helm package follows the symlinks to deploy/ (dashboard, rules)" package_check

# --- the README's parameter tables --------------------------------------------------------------
readme_check() {
  cp "$CHART/README.md" "$work/README.md"
  "$BIN/readme-generator" --values "$CHART/values.yaml" --readme "$work/README.md" >"$work/readme.log" 2>&1 \
    || { cat "$work/readme.log"; return 1; }
  diff -u "$CHART/README.md" "$work/README.md" \
    || { echo "the README's parameter tables are out of date: run $BIN/readme-generator --values $CHART/values.yaml --readme $CHART/README.md"; return 1; }
}
check "README parameters match values.yaml (@param)" readme_check

# --- helm-unittest ------------------------------------------------------------------------------
echo "---- helm-unittest"
if "$BIN/helm-unittest" --color=false "$CHART" >"$work/unittest.log" 2>&1; then ut_ok=1; else ut_ok=0; fi
grep -v 'found symbolic link in path' "$work/unittest.log" | grep -E '^\s*(PASS|FAIL)|^\s+- |Tests:|Error' || true
if [ "$ut_ok" = 0 ]; then grep -v 'found symbolic link in path' "$work/unittest.log" | tail -n 80; fi
add_counts "$work/unittest.log" 'Tests:'
if [ "$ut_ok" = 0 ] && ! grep -E '^\s*Tests:' "$work/unittest.log" | grep -qE '[1-9][0-9]* failed'; then
  failed=$((failed + 1)) # helm-unittest failed without counting a failed test
fi

# --- checksums: a configuration change rolls exactly the pods it concerns ----------------------
"$PY" tests/chart/checksums.py "$BIN/helm" "$CHART" >"$work/checksums.log" 2>&1 || true
grep -v -e '^checks:' -e 'found symbolic link in path' "$work/checksums.log" || true
add_counts "$work/checksums.log" 'checks:'

# --- the binary check ---------------------------------------------------------------------------
echo "---- binary check ($IMDEDUP_BIN)"
if [ ! -x "$IMDEDUP_BIN" ]; then
  echo "FAIL $IMDEDUP_BIN is missing: build it with cargo build -p imdedup (or set IMDEDUP_BIN)"
  failed=$((failed + 1))
else
  "$PY" tests/chart/check_config.py "$IMDEDUP_BIN" "${renders[@]}" >"$work/binary.log" 2>&1 || true
  grep -v '^checks:' "$work/binary.log" || true
  add_counts "$work/binary.log" 'checks:'
fi

echo "chart: $passed passed, $failed failed"
[ "$failed" = 0 ]
