#!/usr/bin/env bash
# A single-node Kubernetes on loopback, from real components built by build.sh:
#   etcd -> kube-apiserver -> kube-controller-manager + kube-scheduler -> containerd (+runc) -> kubelet
# then local images (no registry: a pause image and a busybox image are assembled here from
# files, and localhost/imdedup:dev is imported from podman if it exists) and a pod that really runs.
#
#   tests/kube/single-node.sh            run the checks, tear everything down
#   KEEP=1 tests/kube/single-node.sh     leave the cluster running (prints KUBECONFIG and a stop
#                                             command) for e.g. helm install of the chart
#   EXTRA="cmd" ...                           run cmd (with KUBECONFIG set) before the teardown
#   CHART=k8s/imdedup ...                     also helm install the chart with the local image and
#                                             report how far its pods get (CHART_ARGS, CHART_WAIT=60;
#                                             internalTls.enabled=false: no cert-manager runs here)
#
# Every listener is on 127.0.0.1. Pod network: each pod gets its own network namespace with only
# `lo` (a tiny CNI plugin written here reports an address from TEST-NET-1 192.0.2.0/24 that is
# bound nowhere), so nothing a pod listens on is reachable from outside the pod. Probes that use the
# pod IP therefore fail; exec probes work.
#
# Sandbox specifics handled here: no CAP_SYS_RESOURCE (containerd restrict_oom_score_adj), hybrid cgroup v1 layout (kubelet failCgroupV1=false, cgroupfs
# driver), no swap accounting (failSwapOn=false), kubelet may not use a loopback node IP (so the node
# is named `localhost` and the apiserver reaches the kubelet by Hostname), no registry (images
# imported with `ctr -n k8s.io images import`).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NODE=localhost
PAUSE_IMAGE=localhost/pause:imdedup
BUSYBOX_IMAGE=localhost/busybox:static
IMDEDUP_IMAGE="${IMDEDUP_IMAGE:-localhost/imdedup:dev}"

FAILED=0
pass() { printf 'PASS  %s\n' "$1"; }
fail() { FAILED=$((FAILED+1)); printf 'FAIL  %s\n' "$1"; [ -z "${2:-}" ] || [ ! -f "$2" ] || sed 's/^/      | /' "$2" | tail -n "${FAIL_LINES:-30}"; }
info() { printf 'INFO  %s\n' "$*"; }
die()  { fail "$@"; exit 1; }

S="$(mktemp -d /tmp/imdedup-single-node.XXXXXX)"
mkdir -p "$S"/{logs,certs,etcd,kubelet,containerd,cni/bin,cni/net.d,images}
PIDS=()   # in start order; stopped in reverse order
NETNS_BEFORE="$(ls /var/run/netns 2>/dev/null | tr '\n' ' ')"
RUNC_BEFORE="$(ls /run/containerd/runc/k8s.io 2>/dev/null | tr '\n' ' ')"
KUBEPODS_BEFORE=0; [ -d /sys/fs/cgroup/memory/kubepods ] && KUBEPODS_BEFORE=1
start() { # name, cmd...
  local name="$1"; shift
  "$@" >"$S/logs/$name.log" 2>&1 &
  PIDS+=("$!:$name")
}
stop_pid() {
  local pid="$1" i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < ${3:-15} * 10; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && { echo "($2 ignored TERM, killing)" >&2; kill -KILL "$pid" 2>/dev/null; }
  wait "$pid" 2>/dev/null || true
}
CTR() { ctr --address "$S/containerd/containerd.sock" -n k8s.io "$@"; }
teardown() {
  local i entry
  # pods first, while kubelet and containerd still run
  if [ -n "${KUBECONFIG:-}" ] && [ -f "$KUBECONFIG" ]; then
    timeout 20 "$KBIN/kubectl" delete deployments,statefulsets,daemonsets,replicasets,jobs --all --all-namespaces --wait=false >/dev/null 2>&1 || true
    timeout 20 "$KBIN/kubectl" delete pods --all --all-namespaces --grace-period=1 --wait=true >/dev/null 2>&1 || true
  fi
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    entry="${PIDS[$i]}"
    if [ "${entry#*:}" = containerd ]; then
      # containers live in containerd-shim processes that outlive containerd: kill their tasks
      for t in $(CTR tasks ls -q 2>/dev/null); do CTR tasks kill -s KILL "$t" >/dev/null 2>&1; done
      sleep 1
      for t in $(CTR tasks ls -q 2>/dev/null); do CTR tasks delete -f "$t" >/dev/null 2>&1; done
      for c in $(CTR containers ls -q 2>/dev/null); do CTR containers delete "$c" >/dev/null 2>&1; done
    fi
    stop_pid "${entry%%:*}" "${entry#*:}" 20
  done
  # shims still around (their parent containerd is gone) and mounts under the state dir
  for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $S/" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  awk -v s="$S/" 'index($2, s) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
  # pod network namespaces (containerd pins them in /var/run/netns) and runc state of our containers
  for ns in $(ls /var/run/netns 2>/dev/null); do
    case "$ns" in cni-*) ;; *) continue ;; esac
    case " $NETNS_BEFORE " in *" $ns "*) ;; *) umount "/var/run/netns/$ns" 2>/dev/null; rm -f "/var/run/netns/$ns" ;; esac
  done
  for c in $(ls /run/containerd/runc/k8s.io 2>/dev/null); do
    case " $RUNC_BEFORE " in *" $c "*) ;; *) rm -rf "/run/containerd/runc/k8s.io/$c" ;; esac
  done
  # the kubelet's (now empty) cgroups, unless they existed before
  [ "$KUBEPODS_BEFORE" = 1 ] || for h in /sys/fs/cgroup/*/kubepods; do
    [ -d "$h" ] && find "$h" -depth -type d -exec rmdir {} + 2>/dev/null
  done
  rm -rf "$S"
}
cleanup() {
  local rc=$?
  if [ "${KEEP:-0}" = 1 ] && [ "${READY:-0}" = 1 ]; then
    {
      echo "cluster left running: export KUBECONFIG=$S/kubeconfig"
      echo "stop it with: kill -TERM $$ (this script waits) or Ctrl-C"
    } >&2
    trap - INT TERM; trap 'teardown; exit 0' INT TERM
    while true; do sleep 3600 & wait $!; done
  fi
  teardown
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# shellcheck source=ports.sh
source "$HERE/ports.sh"
wait_for() { # seconds, pid-or-empty, cmd...
  local secs="$1" pid="$2" i; shift 2
  for ((i = 0; i < secs * 2; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    [ -z "$pid" ] || kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}
last_pid() { echo "${PIDS[-1]%%:*}"; }

# --- binaries and packages ---------------------------------------------------------------------------------------
KBIN="$("$HERE/build.sh" --all 2>"$S/logs/build.log" | tail -n1)"
for b in kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet; do
  [ -x "$KBIN/$b" ] || die "kube binaries (build.sh --all): $b missing" "$S/logs/build.log"
done
need=()
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/loopback ] || need+=(containernetworking-plugins)
command -v iptables >/dev/null || need+=(iptables)
command -v conntrack >/dev/null || need+=(conntrack)
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "${need[@]}" >"$S/logs/apt.log" 2>&1 \
    || die "apt-get install ${need[*]}" "$S/logs/apt.log"
fi
# a static busybox for the test image, unpacked from the Debian package (not installed)
BUSYBOX="${IMDEDUP_KUBE_CACHE:-$HOME/.cache/imdedup/kube}/busybox-static/bin/busybox"
if [ ! -x "$BUSYBOX" ]; then
  d="$(dirname "$(dirname "$BUSYBOX")")"; mkdir -p "$d/deb"
  (cd "$d/deb" && apt-get download busybox-static && dpkg-deb -x busybox-static_*.deb "$d") >"$S/logs/busybox.log" 2>&1 \
    || die "busybox-static (apt-get download)" "$S/logs/busybox.log"
fi
KUBECTL="$KBIN/kubectl"
info "$("$KBIN/kubelet" --version), $(containerd --version | awk '{print $1, $3}'), $(runc --version | head -1), state $S"

# --- etcd + kube-apiserver ----------------------------------------------------------------------------------------
read -r P_ETCD P_PEER P_API P_KCM P_SCHED P_KUBELET P_KUBELET_HEALTHZ < <(free_ports 7)
start etcd etcd --name default --data-dir "$S/etcd" \
  --listen-client-urls "http://127.0.0.1:$P_ETCD" --advertise-client-urls "http://127.0.0.1:$P_ETCD" \
  --listen-peer-urls "http://127.0.0.1:$P_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$P_PEER" \
  --initial-cluster "default=http://127.0.0.1:$P_PEER" --listen-metrics-urls ""
wait_for 30 "$(last_pid)" curl -fsS "http://127.0.0.1:$P_ETCD/health" && pass "etcd on 127.0.0.1:$P_ETCD" || die "etcd" "$S/logs/etcd.log"

openssl genrsa -out "$S/certs/sa.key" 2048 >/dev/null 2>&1 && openssl rsa -in "$S/certs/sa.key" -pubout -out "$S/certs/sa.pub" >/dev/null 2>&1
tok() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
ADMIN_TOKEN="$(tok)"; NODE_TOKEN="$(tok)"
{ echo "$ADMIN_TOKEN,admin,admin-uid,system:masters"; echo "$NODE_TOKEN,system:node:$NODE,node-uid,system:nodes"; } >"$S/certs/tokens.csv"
start kube-apiserver "$KBIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$P_ETCD" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$P_API" --endpoint-reconciler-type=none \
  --cert-dir="$S/certs" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$S/certs/sa.pub" --service-account-signing-key-file="$S/certs/sa.key" \
  --service-cluster-ip-range=10.96.0.0/16 \
  --token-auth-file="$S/certs/tokens.csv" --authorization-mode=Node,RBAC \
  --kubelet-preferred-address-types=Hostname --allow-privileged=true --profiling=false
API_PID="$(last_pid)"
kubeconfig() { # file, token
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: "https://127.0.0.1:$P_API", certificate-authority: "$S/certs/apiserver.crt"}
users:
- name: u
  user: {token: "$2"}
contexts:
- name: local
  context: {cluster: local, user: u}
current-context: local
EOF
}
api_ready() { [ -s "$S/certs/apiserver.crt" ] && kubeconfig "$S/kubeconfig" "$ADMIN_TOKEN" && "$KUBECTL" --kubeconfig "$S/kubeconfig" get --raw /readyz; }
wait_for 120 "$API_PID" api_ready && pass "kube-apiserver on https://127.0.0.1:$P_API" || die "kube-apiserver" "$S/logs/kube-apiserver.log"
export KUBECONFIG="$S/kubeconfig"
kubeconfig "$S/kubelet.kubeconfig" "$NODE_TOKEN"

# --- controller-manager + scheduler ---------------------------------------------------------------------------------
start kube-controller-manager "$KBIN/kube-controller-manager" --kubeconfig="$KUBECONFIG" \
  --authentication-kubeconfig="$KUBECONFIG" --authorization-kubeconfig="$KUBECONFIG" \
  --bind-address=127.0.0.1 --secure-port="$P_KCM" --leader-elect=false \
  --service-account-private-key-file="$S/certs/sa.key" --root-ca-file="$S/certs/apiserver.crt" \
  --use-service-account-credentials=false --controllers='*' --cert-dir="$S/certs/kcm"
KCM_PID="$(last_pid)"
start kube-scheduler "$KBIN/kube-scheduler" --kubeconfig="$KUBECONFIG" \
  --authentication-kubeconfig="$KUBECONFIG" --authorization-kubeconfig="$KUBECONFIG" \
  --bind-address=127.0.0.1 --secure-port="$P_SCHED" --leader-elect=false --cert-dir="$S/certs/sched"
SCHED_PID="$(last_pid)"
wait_for 60 "$KCM_PID" curl -fsSk "https://127.0.0.1:$P_KCM/healthz" && pass "kube-controller-manager healthy (127.0.0.1:$P_KCM)" || die "kube-controller-manager" "$S/logs/kube-controller-manager.log"
wait_for 60 "$SCHED_PID" curl -fsSk "https://127.0.0.1:$P_SCHED/healthz" && pass "kube-scheduler healthy (127.0.0.1:$P_SCHED)" || die "kube-scheduler" "$S/logs/kube-scheduler.log"
wait_for 60 "" "$KUBECTL" get serviceaccount default -n default && pass "controllers work: ServiceAccount default/default created" \
  || fail "ServiceAccount default/default (serviceaccount controller)" "$S/logs/kube-controller-manager.log"

# --- containerd -------------------------------------------------------------------------------------------------------
# the CNI plugin: pod netns keeps only lo (brought up by containerd's loopback network); reports a
# TEST-NET-1 address bound nowhere, because the CRI wants an IP for eth0
cat >"$S/cni/bin/lo-only" <<'EOF'
#!/bin/sh
cat >/dev/null
case "$CNI_COMMAND" in
  ADD) n=$( (flock 9; n=$(( $(cat "$0.next" 2>/dev/null || echo 1) + 1 ))
              [ "$n" -le 254 ] || n=2; echo "$n" >"$0.next"; echo "$n") 9>"$0.lock")
       printf '{"cniVersion":"0.4.0","interfaces":[{"name":"%s","sandbox":"%s"}],"ips":[{"version":"4","address":"192.0.2.%s/32","interface":0}]}\n' "$CNI_IFNAME" "$CNI_NETNS" "$n" ;;
  VERSION) echo '{"cniVersion":"0.4.0","supportedVersions":["0.3.0","0.3.1","0.4.0"]}' ;;
  *) exit 0 ;;
esac
EOF
chmod +x "$S/cni/bin/lo-only"; ln -s /usr/lib/cni/loopback "$S/cni/bin/loopback"
echo '{"cniVersion":"0.4.0","name":"lo-only","plugins":[{"type":"lo-only"}]}' >"$S/cni/net.d/10-lo-only.conflist"
cat >"$S/containerd/config.toml" <<EOF
version = 2
root = "$S/containerd/root"
state = "$S/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$S/containerd/containerd.sock"
[ttrpc]
  address = "$S/containerd/containerd.ttrpc.sock"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # the sandbox lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj (kubelet asks -998 for the
  # pause container) and fails with "can't get final child's PID from pipe: EOF"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "${RUNC:-$(command -v runc)}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$S/cni/bin"
    conf_dir = "$S/cni/net.d"
EOF
start containerd containerd --config "$S/containerd/config.toml"
wait_for 30 "$(last_pid)" CTR version && pass "containerd ($S/containerd/containerd.sock)" || die "containerd" "$S/logs/containerd.log"

# --- images -------------------------------------------------------------------------------------------------------
# docker-archive tarball from files: image NAME, entrypoint JSON, files (src:dst)...
make_image() {
  python3 - "$@" <<'EOF'
import hashlib, io, json, os, sys, tarfile
out, name, entrypoint, *files = sys.argv[1:]
layer = io.BytesIO()
with tarfile.open(fileobj=layer, mode="w") as t:
    for spec in files:
        src, dst = spec.split(":", 1)
        if src == "@symlink":          # @symlink:dst=target
            dst, target = dst.split("=", 1)
            i = tarfile.TarInfo(dst.lstrip("/")); i.type = tarfile.SYMTYPE; i.linkname = target; t.addfile(i)
        elif src == "@dir":
            i = tarfile.TarInfo(dst.lstrip("/")); i.type = tarfile.DIRTYPE; i.mode = 0o1777 if dst.rstrip("/") == "/tmp" else 0o755; t.addfile(i)
        else:
            t.add(src, arcname=dst.lstrip("/"))
layer = layer.getvalue()
diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
config = json.dumps({"architecture": "amd64", "os": "linux",
    "config": {"Entrypoint": json.loads(entrypoint), "Env": ["PATH=/bin"]},
    "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    "history": [{"created_by": "tests/kube/single-node.sh"}]}).encode()
cfg_name = hashlib.sha256(config).hexdigest() + ".json"
with tarfile.open(out, "w") as t:
    def add(n, data):
        i = tarfile.TarInfo(n); i.size = len(data); t.addfile(i, io.BytesIO(data))
    add(cfg_name, config)
    add("layer.tar", layer)
    add("manifest.json", json.dumps([{"Config": cfg_name, "RepoTags": [name], "Layers": ["layer.tar"]}]).encode())
EOF
}
# pause: a static Go binary that sleeps until SIGTERM/SIGINT and reaps zombies
mkdir -p "$S/images/pause"
cat >"$S/images/pause/main.go" <<'EOF'
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
EOF
(cd "$S/images/pause" && printf 'module pause\n\ngo 1.21\n' >go.mod && CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o pause . ) >"$S/logs/images.log" 2>&1 \
  && make_image "$S/images/pause.tar" "$PAUSE_IMAGE" '["/pause"]' "$S/images/pause/pause:/pause" >>"$S/logs/images.log" 2>&1 \
  && make_image "$S/images/busybox.tar" "$BUSYBOX_IMAGE" '["/bin/busybox"]' "$BUSYBOX:/bin/busybox" "@symlink:/bin/sh=busybox" "@dir:/tmp" >>"$S/logs/images.log" 2>&1 \
  && CTR images import "$S/images/pause.tar" >>"$S/logs/images.log" 2>&1 \
  && CTR images import "$S/images/busybox.tar" >>"$S/logs/images.log" 2>&1 \
  && pass "images imported: $PAUSE_IMAGE, $BUSYBOX_IMAGE" || die "local images" "$S/logs/images.log"
HAVE_IMDEDUP=0
if command -v podman >/dev/null && podman image exists "$IMDEDUP_IMAGE" 2>/dev/null; then
  if podman save --format docker-archive -o "$S/images/imdedup.tar" "$IMDEDUP_IMAGE" >>"$S/logs/images.log" 2>&1 \
     && CTR images import "$S/images/imdedup.tar" >>"$S/logs/images.log" 2>&1; then
    HAVE_IMDEDUP=1; rm -f "$S/images/imdedup.tar"; pass "image imported from podman: $IMDEDUP_IMAGE"
  else fail "import $IMDEDUP_IMAGE from podman" "$S/logs/images.log"; fi
else
  info "no podman image $IMDEDUP_IMAGE: imdedup pod skipped"
fi

# --- kubelet -----------------------------------------------------------------------------------------------------------
cat >"$S/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: $P_KUBELET
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $P_KUBELET_HEALTHZ
containerRuntimeEndpoint: unix://$S/containerd/containerd.sock
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
resolvConf: /etc/resolv.conf
evictionHard: {memory.available: "100Mi", nodefs.available: "2%", imagefs.available: "2%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerNode: true
EOF
start kubelet "$KBIN/kubelet" --config="$S/kubelet/config.yaml" --kubeconfig="$S/kubelet.kubeconfig" \
  --root-dir="$S/kubelet/root" --cert-dir="$S/kubelet/pki" --hostname-override="$NODE" -v=2
KUBELET_PID="$(last_pid)"
wait_for 60 "$KUBELET_PID" curl -fsS "http://127.0.0.1:$P_KUBELET_HEALTHZ/healthz" \
  && pass "kubelet healthz (127.0.0.1:$P_KUBELET_HEALTHZ)" \
  || { grep -E '^E|error|Error|fail' "$S/logs/kubelet.log" | tail -20 >"$S/logs/kubelet.err"; die "kubelet start" "$S/logs/kubelet.err"; }
node_ready() { [ "$("$KUBECTL" get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]; }
if wait_for 90 "$KUBELET_PID" node_ready; then pass "node $NODE Ready"
else
  "$KUBECTL" get node "$NODE" -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}' >"$S/logs/node.txt" 2>&1
  grep -E '^E' "$S/logs/kubelet.log" | tail -15 >>"$S/logs/node.txt"
  die "node $NODE Ready" "$S/logs/node.txt"
fi

# --- pods -------------------------------------------------------------------------------------------------------------
run_pod() { # name, image, command...
  local name="$1" image="$2"; shift 2
  local cmd; cmd="$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' "$@")"
  "$KUBECTL" apply -f - <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $name, namespace: default}
spec:
  terminationGracePeriodSeconds: 2
  containers:
  - name: main
    image: $image
    imagePullPolicy: Never
    command: $cmd
    securityContext: {allowPrivilegeEscalation: false}
EOF
}
pod_phase() { "$KUBECTL" get pod "$1" -o jsonpath='{.status.phase}'; }
check_pod() { # name, wanted phase
  local name="$1" want="$2"
  if wait_for 90 "$KUBELET_PID" bash -c '[ "$("$0" get pod "$1" -o jsonpath="{.status.phase}")" = "$2" ]' "$KUBECTL" "$name" "$want"; then
    pass "pod $name $want on node $("$KUBECTL" get pod "$name" -o jsonpath='{.spec.nodeName}') (scheduled by kube-scheduler)"
    return 0
  fi
  { "$KUBECTL" get pod "$name" -o wide; "$KUBECTL" describe pod "$name" | sed -n '/^Events:/,$p'
    "$KUBECTL" get pod "$name" -o jsonpath='{range .status.containerStatuses[*]}{.state}{"\n"}{end}'; } >"$S/logs/pod-$name.txt" 2>&1
  fail "pod $name $want" "$S/logs/pod-$name.txt"; return 1
}
run_pod hello "$BUSYBOX_IMAGE" /bin/sh -c 'echo hello from $(hostname) uid=$(id -u); ip addr 2>/dev/null | grep inet; exec sleep 3600' >/dev/null
if check_pod hello Running; then
  sleep 1
  out="$("$KUBECTL" logs hello 2>&1)" && [[ "$out" == *"hello from hello"* ]] && pass "kubectl logs hello (apiserver -> kubelet): ${out%%$'\n'*}" \
    || { echo "$out" >"$S/logs/logs.txt"; fail "kubectl logs hello" "$S/logs/logs.txt"; }
  out="$("$KUBECTL" exec hello -- /bin/busybox cat /proc/1/cmdline 2>&1 | tr '\0' ' ')" && [[ "$out" == *sleep* ]] && pass "kubectl exec hello (container pid 1: $out)" \
    || { echo "$out" >"$S/logs/exec.txt"; fail "kubectl exec hello" "$S/logs/exec.txt"; }
fi
if [ "$HAVE_IMDEDUP" = 1 ]; then
  # the image's entrypoint is the imdedup binary; `--help` exits 0, so the pod should reach Succeeded
  "$KUBECTL" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: imdedup-help, namespace: default}
spec:
  restartPolicy: Never
  containers:
  - {name: main, image: "$IMDEDUP_IMAGE", imagePullPolicy: Never, args: ["--help"]}
EOF
  check_pod imdedup-help Succeeded && info "imdedup --help in the pod: $("$KUBECTL" logs imdedup-help 2>&1 | head -1)"
fi
# --- the chart, for real (CHART=path, e.g. CHART=k8s/imdedup) -----------------------------------------------------------
# Pods start; they cannot become Ready here: kubelet's HTTP/gRPC probes dial the pod IP, which the
# lo-only pod network does not route (see the header), and there is no cluster DNS (CoreDNS).
if [ -n "${CHART:-}" ] && [ "$HAVE_IMDEDUP" = 1 ]; then
  HELM="$(command -v helm || echo "$(go env GOPATH)/bin/helm")"
  "$KUBECTL" create namespace imdedup >/dev/null
  repo="${IMDEDUP_IMAGE%:*}"; tag="${IMDEDUP_IMAGE##*:}"
  if "$HELM" install imdedup "$CHART" -n imdedup --set image.repository="$repo" --set image.tag="$tag" \
       --set image.pullPolicy=Never --set storage.persistence.enabled=false \
       --set internalTls.enabled=false ${CHART_ARGS:-} >"$S/logs/helm.log" 2>&1; then
    # (no cert-manager here: plaintext internal gRPC, unless CHART_ARGS says otherwise)
    pass "helm install $CHART (image $IMDEDUP_IMAGE, storage on emptyDir, internal TLS off)"
    sleep "${CHART_WAIT:-60}"
    "$KUBECTL" get pods -n imdedup -o wide | sed 's/^/INFO    /'
    for p in $("$KUBECTL" get pods -n imdedup -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}'); do
      phase="$("$KUBECTL" get pod -n imdedup "$p" -o jsonpath='{.status.phase}')"
      if [ "$phase" = Running ]; then
        info "$p Running; first log line: $("$KUBECTL" logs -n imdedup "$p" 2>&1 | sed 's/\x1b\[[0-9;]*m//g' | head -1 | cut -c1-150)"
      fi
      "$KUBECTL" get events -n imdedup --field-selector "involvedObject.name=$p,type=Warning" \
        -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' 2>/dev/null | grep -v MissingClusterDNS | sort -u | head -3 \
        | sed "s/^/INFO      $p: /" | cut -c1-260
    done
  else fail "helm install $CHART" "$S/logs/helm.log"; fi
fi
READY=1
if [ -n "${EXTRA:-}" ]; then info "running EXTRA: $EXTRA"; bash -c "$EXTRA"; fi
printf 'single-node: %s\n' "$([ "$FAILED" = 0 ] && echo 'all PASS' || echo "$FAILED FAIL")"
[ "$FAILED" = 0 ]
