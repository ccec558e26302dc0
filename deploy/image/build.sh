#!/usr/bin/env bash
# Builds the imdedup container image on a machine that cannot pull from any
# container registry, from the repository's Dockerfile:
#
#   1. compiles imdedup and imdedup-load on the host (cargo, release);
#   2. makes the runtime base from Debian packages (debootstrap minbase,
#      trimmed, with the distroless `nonroot` user 65532) and tags it with the
#      Dockerfile's runtime base name, gcr.io/distroless/cc-debian12:nonroot;
#   3. builds the Dockerfile's `image-prebuilt` stage with --pull=never: the
#      same image as the default last stage, `image`, but with the host's
#      binaries (debug info stripped from copies of them) instead of the
#      Rust builder stage, whose base image cannot be pulled here;
#   4. makes the Redis image that tests/image/cluster.sh uses, from the same
#      Debian release with redis-server.
#
#   deploy/image/build.sh            # -> localhost/imdedup:<version>, localhost/imdedup:dev,
#                                    #    localhost/imdedup-redis:bookworm
#
# The debootstrap root filesystems are cached as tarballs under
# ~/.cache/imdedup/image/, so a second run takes seconds once cargo is done.
# Environment: IMDEDUP_DEBIAN_MIRROR (default: the first Debian URI in the apt
# sources), IMDEDUP_CACHE (default ~/.cache/imdedup), IMDEDUP_SKIP_CARGO=1
# (use target/release as it is). Needs root (debootstrap, rootful podman).
# See deploy/image/README.md.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=${IMDEDUP_CACHE:-${HOME:-/tmp}/.cache/imdedup}/image
SUITE=bookworm
# Bump when the base recipe below changes, so a cached rootfs is rebuilt.
RECIPE=1
BASE_TAR=$CACHE/debian-$SUITE-minbase-r$RECIPE.tar
REDIS_TAR=$CACHE/debian-$SUITE-redis-r$RECIPE.tar
RUNTIME_BASE=gcr.io/distroless/cc-debian12:nonroot
IMAGE=localhost/imdedup
REDIS_IMAGE=localhost/imdedup-redis:$SUITE
NONROOT=65532

log() { printf 'build: %s\n' "$*" >&2; }
die() { printf 'build: ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (debootstrap and rootful podman)"
mkdir -p "$CACHE"

# ------------------------------------------------------------------ tools

ensure_tools() {
  local missing=() tool
  for tool in podman buildah runc fuse-overlayfs newuidmap debootstrap netavark objcopy; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/lib/podman/$tool" ] || missing+=("$tool")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  log "missing: ${missing[*]}; installing with apt-get"
  local alog=$CACHE/apt.log
  apt-get update -q >"$alog" 2>&1 || { tail -n 20 "$alog" >&2; die "apt-get update failed (log: $alog)"; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    podman buildah runc fuse-overlayfs uidmap debootstrap netavark aardvark-dns binutils >>"$alog" 2>&1 \
    || { tail -n 20 "$alog" >&2; die "apt-get install failed (log: $alog)"; }
}

# The Debian mirror apt uses here (deb822 .sources or one-line sources.list).
debian_mirror() {
  if [ -n "${IMDEDUP_DEBIAN_MIRROR:-}" ]; then
    printf '%s\n' "$IMDEDUP_DEBIAN_MIRROR"
    return
  fi
  local uri
  uri=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
    awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }
         /^deb[ \t]/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z+]+:\/\//) { print $i; break } }' |
    grep -v -e security -e backports | grep -m1 '/debian/\?$' || true)
  printf '%s\n' "${uri:-http://deb.debian.org/debian}"
}

# ---------------------------------------------------------------- rootfs

# Removes what a runtime image never reads: docs, man pages, locales, apt's
# lists and caches, logs.
trim_rootfs() { # DIR
  local d=$1
  rm -rf "$d"/usr/share/doc/* "$d"/usr/share/man/* "$d"/usr/share/info/* \
    "$d"/usr/share/locale/* "$d"/usr/share/lintian "$d"/usr/share/bug \
    "$d"/var/cache/apt/* "$d"/var/lib/apt/lists/* "$d"/var/cache/debconf/*-old \
    "$d"/var/cache/ldconfig/* "$d"/var/log/* "$d"/tmp/* "$d"/var/tmp/*
}

# The distroless `nonroot` user and group (65532), home /home/nonroot.
add_nonroot() { # DIR
  local d=$1
  grep -q "^nonroot:" "$d/etc/passwd" ||
    echo "nonroot:x:$NONROOT:$NONROOT:nonroot:/home/nonroot:/usr/sbin/nologin" >>"$d/etc/passwd"
  grep -q "^nonroot:" "$d/etc/group" || echo "nonroot:x:$NONROOT:" >>"$d/etc/group"
  grep -q "^nonroot:" "$d/etc/shadow" || echo "nonroot:*:19000:0:99999:7:::" >>"$d/etc/shadow"
  install -d -m 0700 -o "$NONROOT" -g "$NONROOT" "$d/home/nonroot"
}

# debootstrap SUITE into a scratch dir, trim it, tar it to OUT (atomically).
make_rootfs() { # OUT [debootstrap options...]
  local out=$1
  shift
  local work mirror
  work=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  mirror=$(debian_mirror)
  log "debootstrap $SUITE from $mirror ($*) -> $(basename "$out") (about a minute)"
  if ! debootstrap --variant=minbase "$@" "$SUITE" "$work/root" "$mirror" >"$work.log" 2>&1; then
    tail -n 20 "$work.log" >&2
    rm -rf "$work"
    die "debootstrap failed (log: $work.log)"
  fi
  trim_rootfs "$work/root"
  add_nonroot "$work/root"
  tar --numeric-owner --xattrs -C "$work/root" \
    --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -cf "$out.part" .
  mv "$out.part" "$out"
  rm -rf "$work" "$work.log"
}

# podman import TAR as NAME, unless NAME already holds this TAR (same label).
import_rootfs() { # TAR NAME [--change ...]
  local tar=$1 name=$2
  shift 2
  local id have
  id="$(basename "$tar")@$(stat -c %Y "$tar")"
  have=$(podman image inspect --format '{{ index .Labels "imdedup.rootfs" }}' "$name" 2>/dev/null || true)
  if [ "$have" = "$id" ]; then
    log "$name is up to date ($id)"
    return
  fi
  log "podman import $(basename "$tar") -> $name"
  podman import --change "LABEL=imdedup.rootfs=$id" "$@" "$tar" "$name" >/dev/null
}

# ------------------------------------------------------------------ steps

ensure_tools

VERSION=$(awk '/^\[workspace\.package\]/ { p = 1; next } /^\[/ { p = 0 }
  p && /^version *=/ { gsub(/[" ]/, "", $0); sub(/^version=/, "", $0); print; exit }' "$ROOT/Cargo.toml")
[ -n "$VERSION" ] || die "no version in $ROOT/Cargo.toml [workspace.package]"
REVISION=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)

# The root filesystems first: they need only the network, cargo the cores.
[ -f "$BASE_TAR" ] || make_rootfs "$BASE_TAR" --include=ca-certificates
[ -f "$REDIS_TAR" ] || make_rootfs "$REDIS_TAR" --include=redis-server

if [ "${IMDEDUP_SKIP_CARGO:-0}" != 1 ]; then
  log "cargo build --release --locked -p imdedup -p imdedup-loadtest"
  (cd "$ROOT" && cargo build --release --locked -p imdedup -p imdedup-loadtest)
fi
for bin in imdedup imdedup-load; do
  [ -x "$ROOT/target/release/$bin" ] || die "missing $ROOT/target/release/$bin"
done

# Every shared library the binaries load must be in the base; distroless cc
# has glibc and libgcc_s, and so does Debian's minbase.
libs=$(ldd "$ROOT/target/release/imdedup" "$ROOT/target/release/imdedup-load" |
  awk '$2 == "=>" { print $1 }' | sort -u | tr '\n' ' ')
log "shared libraries needed: $libs"

import_rootfs "$BASE_TAR" "$RUNTIME_BASE" \
  --change "USER=$NONROOT" --change "WORKDIR=/home/nonroot" \
  --change "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change "ENV=SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"

# The build context is a staging directory holding what `image-prebuilt`
# copies, target/release/imdedup{,-load}, as copies without debug info
# (symbols stay, so backtraces keep function names): about 27 MB each
# instead of about 130 MB with the release profile's line tables. The shared
# target/ is never modified, and the sources are not sent as context.
CTX=$(mktemp -d "$CACHE/context.XXXXXX")
trap 'rm -rf "$CTX"' EXIT
mkdir -p "$CTX/target/release"
cp "$ROOT/Dockerfile" "$ROOT/.dockerignore" "$CTX/"
for bin in imdedup imdedup-load; do
  objcopy --strip-debug "$ROOT/target/release/$bin" "$CTX/target/release/$bin"
done

log "podman build --target image-prebuilt --pull=never -> $IMAGE:$VERSION, $IMAGE:dev"
podman build --pull=never -f "$CTX/Dockerfile" --target image-prebuilt \
  --build-arg "RUNTIME_BASE=$RUNTIME_BASE" \
  --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION" \
  -t "$IMAGE:$VERSION" -t "$IMAGE:dev" "$CTX" >&2

import_rootfs "$REDIS_TAR" "$REDIS_IMAGE" \
  --change "USER=redis" --change "WORKDIR=/var/lib/redis" \
  --change 'ENTRYPOINT=["/usr/bin/redis-server"]' --change "EXPOSE=6379"

podman image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' |
  grep -e "^$IMAGE:" -e "^$REDIS_IMAGE" -e "^$RUNTIME_BASE" >&2
printf '%s\n' "$IMAGE:$VERSION"
