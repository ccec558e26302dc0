#!/usr/bin/env bash
# Installs the chart tools into a cache dir, idempotently and offline except
# for the package registries (Go module proxy, PyPI, npm):
#
#   bin/helm            helm.sh/helm/v3 (go install)
#   bin/kubeconform     github.com/yannh/kubeconform (go install)
#   bin/helm-unittest   github.com/helm-unittest/helm-unittest (go mod download
#                       + go build: `go install` refuses its replace directives)
#   bin/readme-generator  @bitnami/readme-generator-for-helm (npm)
#   venv/               Python venv with kubernetes-validate and PyYAML
#   schemas/k8s/vX.Y.Z-standalone-strict/   the Kubernetes JSON schemas that
#                       kubernetes-validate ships, made usable by kubeconform
#   schemas/crds/<group>/<kind>_<version>.json  strict JSON schemas of the
#                       prometheus-operator CRDs (ServiceMonitor, PrometheusRule, ...)
#                       and the cert-manager CRDs (Certificate, Issuer, ClusterIssuer, ...)
#
# Each piece has a stamp file naming its version; a second run only checks the
# stamps. Progress goes to stderr; the last line of stdout is the cache dir.
#
# Usage: tests/chart/tools.sh
# Env: IMDEDUP_TOOLS_CACHE (default ~/.cache/imdedup/tools)
set -euo pipefail

HELM_VERSION="v3.22.0"
# The Kubernetes minor of helm's client-go (its Makefile stamps it in; `go
# install` alone leaves helm defaulting to v1.20, below the chart's kubeVersion).
HELM_K8S_MINOR="37"
KUBECONFORM_VERSION="v0.8.0"
HELM_UNITTEST_VERSION="v1.1.2"
HELM_UNITTEST_K8S_MINOR="36"
README_GENERATOR_VERSION="2.7.2"
KUBERNETES_VALIDATE_VERSION="1.37.0"
PYYAML_VERSION="6.0.3"
PROMETHEUS_OPERATOR_VERSION="v0.94.1"
# cert-manager: the CRDs of the Certificates and Issuers the chart renders
# for internal mutual TLS. Taken from its Helm chart's templates (what a
# cluster installs), with the whole-line template directives dropped.
CERT_MANAGER_VERSION="v1.21.2"
# Kubernetes versions the renders are validated against: the chart's minimum
# (native preStop sleep is GA-ready from 1.30) and the newest schemas shipped.
K8S_SCHEMA_VERSIONS="v1.30.0 v1.37.0"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${IMDEDUP_TOOLS_CACHE:-$HOME/.cache/imdedup/tools}"
BIN="$CACHE/bin"
STAMPS="$CACHE/stamps"
mkdir -p "$BIN" "$STAMPS"

log() { echo "[tools] $*" >&2; }
need() { command -v "$1" >/dev/null 2>&1 || { echo "tools: $1 is not on PATH; $2" >&2; exit 1; }; }
stamped() { [ "$(cat "$STAMPS/$1" 2>/dev/null)" = "$2" ]; }
stamp() { echo "$2" >"$STAMPS/$1"; }

# go install into our bin dir; the module cache is Go's own (shared, so a
# second project build is fast).
go_install() { # name module@version [ldflags]
  local name="$1" module="$2" ldflags="${3:-}"
  if stamped "$name" "$module $ldflags" && [ -x "$BIN/$name" ]; then return; fi
  need go "install Go (https://go.dev/doc/install)"
  log "building $name from $module (go install; a few minutes cold)"
  GOBIN="$BIN" GOFLAGS=-buildvcs=false go install -ldflags "$ldflags" "$module" >&2
  stamp "$name" "$module $ldflags"
}

helm_k8s_ldflags() { # go package prefix, minor
  echo "-X $1/pkg/chartutil.k8sVersionMajor=1 -X $1/pkg/chartutil.k8sVersionMinor=$2 -X $1/pkg/lint/rules.k8sVersionMajor=1 -X $1/pkg/lint/rules.k8sVersionMinor=$2"
}

go_install helm "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" \
  "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.metadata= $(helm_k8s_ldflags helm.sh/helm/v3 "$HELM_K8S_MINOR")"
go_install kubeconform "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"

# helm-unittest: its go.mod has replace directives, so `go install` refuses.
# Download the module source and build it as the main module.
if ! stamped helm-unittest "$HELM_UNITTEST_VERSION 1.$HELM_UNITTEST_K8S_MINOR" || [ ! -x "$BIN/helm-unittest" ]; then
  need go "install Go (https://go.dev/doc/install)"
  log "building helm-unittest $HELM_UNITTEST_VERSION (go mod download + go build)"
  dir="$(cd "$CACHE" && go mod download -json "github.com/helm-unittest/helm-unittest@$HELM_UNITTEST_VERSION" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  rm -rf "$CACHE/src/helm-unittest"
  mkdir -p "$CACHE/src"
  cp -r "$dir" "$CACHE/src/helm-unittest"
  chmod -R u+w "$CACHE/src/helm-unittest"
  (cd "$CACHE/src/helm-unittest" && GOFLAGS=-buildvcs=false go build \
    -ldflags "$(helm_k8s_ldflags helm.sh/helm/v3 "$HELM_UNITTEST_K8S_MINOR")" \
    -o "$BIN/helm-unittest" ./cmd/helm-unittest >&2)
  stamp helm-unittest "$HELM_UNITTEST_VERSION 1.$HELM_UNITTEST_K8S_MINOR"
fi

# The README parameter tables, bitnami style.
if ! stamped readme-generator "$README_GENERATOR_VERSION" || [ ! -x "$BIN/readme-generator" ]; then
  need npm "install Node.js and npm (apt-get install -y nodejs npm)"
  log "installing @bitnami/readme-generator-for-helm $README_GENERATOR_VERSION (npm)"
  rm -rf "$CACHE/npm"
  npm install --silent --no-audit --no-fund --prefix "$CACHE/npm" \
    "@bitnami/readme-generator-for-helm@$README_GENERATOR_VERSION" >&2
  ln -sf "$CACHE/npm/node_modules/.bin/readme-generator" "$BIN/readme-generator"
  stamp readme-generator "$README_GENERATOR_VERSION"
fi

# Python venv: kubernetes-validate (ships the Kubernetes JSON schemas) and PyYAML.
PY="$CACHE/venv/bin/python"
py_want="kubernetes-validate==$KUBERNETES_VALIDATE_VERSION pyyaml==$PYYAML_VERSION"
if ! stamped venv "$py_want" || [ ! -x "$PY" ]; then
  need python3 "install Python 3"
  log "creating the Python venv ($py_want)"
  rm -rf "$CACHE/venv"
  python3 -m venv "$CACHE/venv"
  "$PY" -m pip install --quiet --disable-pip-version-check $py_want >&2
  stamp venv "$py_want"
fi

# Kubernetes schemas: copied out of kubernetes-validate's package folder and
# fixed so kubeconform can load them ($id dropped, refs made relative).
schemas_want="$KUBERNETES_VALIDATE_VERSION $K8S_SCHEMA_VERSIONS"
if ! stamped k8s-schemas "$schemas_want"; then
  log "preparing the offline Kubernetes schemas ($K8S_SCHEMA_VERSIONS)"
  src="$("$PY" -c 'import kubernetes_validate, os; print(os.path.join(os.path.dirname(kubernetes_validate.__file__), "kubernetes-json-schema"))')"
  rm -rf "$CACHE/schemas/k8s"
  for v in $K8S_SCHEMA_VERSIONS; do
    "$PY" "$here/schemas.py" k8s "$src/$v-local-strict" "$CACHE/schemas/k8s/$v-standalone-strict"
  done
  stamp k8s-schemas "$schemas_want"
fi

# prometheus-operator and cert-manager CRDs -> strict JSON schemas.
module_dir() { # module@version: the module's source folder (go mod download)
  (cd "$CACHE" && go mod download -json "$1") | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'
}
crds_want="prometheus-operator $PROMETHEUS_OPERATOR_VERSION cert-manager $CERT_MANAGER_VERSION"
if ! stamped crd-schemas "$crds_want"; then
  need go "install Go (https://go.dev/doc/install)"
  log "preparing the CRD schemas: prometheus-operator $PROMETHEUS_OPERATOR_VERSION, cert-manager $CERT_MANAGER_VERSION (go mod download)"
  po="$(module_dir "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION")"
  cm="$(module_dir "github.com/cert-manager/cert-manager@$CERT_MANAGER_VERSION")"
  rm -rf "$CACHE/schemas/crds"
  "$PY" "$here/schemas.py" crds "$po/example/prometheus-operator-crd" "$CACHE/schemas/crds"
  "$PY" "$here/schemas.py" crds "$cm/deploy/charts/cert-manager/templates" "$CACHE/schemas/crds"
  stamp crd-schemas "$crds_want"
fi

log "tools ready in $CACHE"
echo "$CACHE"
