#!/usr/bin/env bash
# Builds real Kubernetes binaries (kube-apiserver, kubectl and, with --all, kube-controller-manager,
# kube-scheduler, kubelet; kube-proxy on request) from the k8s.io/kubernetes Go module into a cache
# dir, CoreDNS (`coredns`) from its own Go module, and installs etcd-server from apt if etcd is missing.
#
# `go install k8s.io/kubernetes/cmd/...@vX` refuses because k8s.io/kubernetes' go.mod replaces its
# k8s.io/* staging modules with ./staging paths. So we build from a small wrapper module whose go.mod
# replaces each of those staging modules with its published v0.<minor>.<patch> version.
#
# Idempotent: a component is skipped when its binary exists with a stamp matching KUBE_VERSION.
#
# CoreDNS: a small main package that imports coremain and only the plugins a cluster DNS uses
# (kubernetes, cache, errors, log, health, ready, reload, loadbalance, hosts, template), so the
# cloud-provider SDKs of the stock build are not compiled; a static binary (CGO_ENABLED=0).
#
# Usage: tests/kube/build.sh [--all | component...]
#   default components: kube-apiserver kubectl
#   --all: also kube-controller-manager kube-scheduler kubelet
#   components: the above, kube-proxy, coredns
# Env: KUBE_VERSION (default below), COREDNS_VERSION (default below),
#      IMDEDUP_KUBE_CACHE (default ~/.cache/imdedup/kube)
# Prints the bin dir on the last line of stdout.
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.37.2}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.15.0}"
ETCD_APT_PACKAGE="${ETCD_APT_PACKAGE:-etcd-server}"
CACHE="${IMDEDUP_KUBE_CACHE:-$HOME/.cache/imdedup/kube}"
BIN="$CACHE/bin"
SRC="$CACHE/src/$KUBE_VERSION"

log() { echo "[kube-build] $*" >&2; }

components=()
for a in "$@"; do
  case "$a" in
    --all) components+=(kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet) ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    kube-apiserver|kubectl|kube-controller-manager|kube-scheduler|kubelet|kube-proxy|coredns) components+=("$a") ;;
    *) echo "unknown argument: $a" >&2; exit 2 ;;
  esac
done
[ ${#components[@]} -gt 0 ] || components=(kube-apiserver kubectl)

# --- etcd -------------------------------------------------------------------------------------
if ! command -v etcd >/dev/null 2>&1; then
  log "installing $ETCD_APT_PACKAGE from apt"
  export DEBIAN_FRONTEND=noninteractive
  apt_install=(apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "$ETCD_APT_PACKAGE")
  "${apt_install[@]}" >&2 || { apt-get -o DPkg::Lock::Timeout=600 update >&2 && "${apt_install[@]}" >&2; }
  # the Debian package may start a system etcd on 127.0.0.1:2379; we run our own on other ports.
fi
log "etcd: $(etcd --version 2>/dev/null | head -1)"

# --- what needs building ------------------------------------------------------------------------
mkdir -p "$BIN"
todo=()
want_coredns=0
for c in "${components[@]}"; do
  if [ "$c" = coredns ]; then
    if [ -x "$BIN/coredns" ] && [ "$(cat "$BIN/.coredns.version" 2>/dev/null)" = "$COREDNS_VERSION" ]; then
      log "coredns $COREDNS_VERSION already built, skipping"
    else
      want_coredns=1
    fi
  elif [ -x "$BIN/$c" ] && [ "$(cat "$BIN/.$c.version" 2>/dev/null)" = "$KUBE_VERSION" ]; then
    log "$c $KUBE_VERSION already built, skipping"
  else
    todo+=("$c")
  fi
done
if [ ${#todo[@]} -eq 0 ] && [ "$want_coredns" = 0 ]; then echo "$BIN"; exit 0; fi

command -v go >/dev/null 2>&1 || { echo "go not found in PATH" >&2; exit 1; }

# --- CoreDNS --------------------------------------------------------------------------------------
if [ "$want_coredns" = 1 ]; then
  csrc="$CACHE/src/coredns-$COREDNS_VERSION"
  mkdir -p "$csrc"
  if [ ! -f "$csrc/.ready" ]; then
    cgomod="$(cd "$csrc" && GOFLAGS=-mod=mod go mod download -json "github.com/coredns/coredns@$COREDNS_VERSION" \
             | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
    [ -f "$cgomod" ] || { echo "could not find go.mod of github.com/coredns/coredns@$COREDNS_VERSION" >&2; exit 1; }
    {
      echo "module imdedup.local/coredns"
      echo
      echo "go $(awk '$1=="go"{print $2; exit}' "$cgomod")"
      echo
      echo "require github.com/coredns/coredns $COREDNS_VERSION"
    } >"$csrc/go.mod"
    {
      echo "// CoreDNS with the plugins a cluster DNS needs (the directive order stays CoreDNS's own)."
      echo "package main"
      echo
      echo "import ("
      echo "	\"github.com/coredns/coredns/coremain\""
      for p in kubernetes cache errors log health ready reload loadbalance hosts template; do
        echo "	_ \"github.com/coredns/coredns/plugin/$p\""
      done
      echo ")"
      echo
      echo "func main() { coremain.Run() }"
    } >"$csrc/main.go"
    log "resolving CoreDNS $COREDNS_VERSION dependencies"
    (cd "$csrc" && GOFLAGS=-mod=mod go mod tidy >&2)
    touch "$csrc/.ready"
  fi
  log "building coredns $COREDNS_VERSION"
  start=$(date +%s)
  (cd "$csrc" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" \
      -o "$BIN/coredns.tmp" . >&2)
  mv -f "$BIN/coredns.tmp" "$BIN/coredns"
  echo "$COREDNS_VERSION" >"$BIN/.coredns.version"
  log "built coredns in $(( $(date +%s) - start ))s"
  if [ ${#todo[@]} -eq 0 ]; then echo "$BIN"; exit 0; fi
fi

# --- wrapper module -----------------------------------------------------------------------------
staging_version="v0.${KUBE_VERSION#v1.}"          # v1.37.2 -> v0.37.2
mkdir -p "$SRC"
if [ ! -f "$SRC/.ready" ]; then
  log "fetching k8s.io/kubernetes@$KUBE_VERSION module metadata"
  gomod="$(cd "$SRC" && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" \
           | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  [ -f "$gomod" ] || { echo "could not find go.mod of k8s.io/kubernetes@$KUBE_VERSION" >&2; exit 1; }
  go_directive="$(awk '$1=="go"{print $2; exit}' "$gomod")"
  godebug="$(grep -E '^godebug ' "$gomod" || true)"
  # staging modules = the `k8s.io/x => ./staging/src/k8s.io/x` replaces
  mapfile -t staging < <(sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/src/.*#\1#p' "$gomod")
  [ ${#staging[@]} -gt 0 ] || { echo "no staging replaces found in $gomod" >&2; exit 1; }
  {
    echo "module imdedup.local/kubebuild"
    echo
    echo "go $go_directive"
    [ -z "$godebug" ] || { echo; echo "$godebug"; }
    echo
    echo "require k8s.io/kubernetes $KUBE_VERSION"
    echo
    echo "replace ("
    for m in "${staging[@]}"; do echo "	$m => $m $staging_version"; done
    echo ")"
  } > "$SRC/go.mod"
  # a file that imports the commands keeps `go mod tidy` from dropping what we build
  {
    echo "//go:build tools"
    echo
    echo "package tools"
    echo
    echo "import ("
    for c in kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet kube-proxy; do
      echo "	_ \"k8s.io/kubernetes/cmd/$c\""
    done
    echo ")"
  } > "$SRC/tools.go"
  log "resolving dependencies (${#staging[@]} staging modules -> $staging_version)"
  (cd "$SRC" && GOFLAGS=-mod=mod go mod tidy >&2)
  touch "$SRC/.ready"
fi

minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

for c in "${todo[@]}"; do
  log "building $c $KUBE_VERSION (cold, on 2 busy cores: kube-apiserver ~15 min, kubelet ~20 min)"
  start=$(date +%s)
  cgo=0; [ "$c" = kubelet ] && cgo=1      # upstream builds kubelet with cgo, the rest static
  # -mod=mod: a wrapper made before a component was added to tools.go gets its go.sum entries now
  (cd "$SRC" && CGO_ENABLED=$cgo GOFLAGS=-mod=mod go build -trimpath -ldflags "$ldflags" \
      -o "$BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c" >&2)
  mv -f "$BIN/$c.tmp" "$BIN/$c"
  echo "$KUBE_VERSION" > "$BIN/.$c.version"
  log "built $c in $(( $(date +%s) - start ))s"
done
echo "$BIN"
