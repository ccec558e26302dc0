# syntax=docker/dockerfile:1
#
# The imdedup image: the `imdedup` binary (subcommands storage, ingest,
# gateway, migrate, token, demo, dev) as the entrypoint, and the load driver
# `imdedup-load`, on a distroless glibc base, running as nonroot (65532).
#
#   docker build -t imdedup:0.1.0 --build-arg VERSION=0.1.0 .
#
# Two final stages, the same image but for where the binaries come from:
#   image           (the last stage, the default) compiles them in the Rust
#                   image, then strips their debug info (the release
#                   profile's line tables; symbols stay, so backtraces keep
#                   function names);
#   image-prebuilt  (--target image-prebuilt) copies them as they are from
#                   target/release/ of the build context, for a host that
#                   built them already (`cargo build --release --locked -p
#                   imdedup -p imdedup-loadtest` on Debian 12, glibc 2.36);
#                   deploy/image/build.sh builds it, without any registry,
#                   from a staging context with stripped copies.
# (Explicit stage names, not a FROM ${ARG} switch: buildah/podman would skip
# a stage that is named only through an ARG.)
# See deploy/image/README.md.

ARG RUST_VERSION=1.95
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12:nonroot

# ---- binaries compiled in the Rust image ------------------------------------
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p imdedup -p imdedup-loadtest \
 && mkdir -p /out \
 && for bin in imdedup imdedup-load; do \
      objcopy --strip-debug "target/release/$bin" "/out/$bin"; \
    done

# ---- runtime ----------------------------------------------------------------
FROM ${RUNTIME_BASE} AS base

# Everything but the binaries.
FROM base AS runtime
ARG VERSION=0.1.0
ARG REVISION=unknown
# The repository has no recorded remote URL; pass the real one if it differs.
ARG SOURCE=https://github.com/imdedup/imdedup
LABEL org.opencontainers.image.title="imdedup" \
      org.opencontainers.image.description="Instant-messaging send path with dedup: gateway, ingest shards and storage in one binary (imdedup), plus the load driver (imdedup-load)" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"

# The embedded store's directory (`imdedup storage`): mount a volume here.
# It must exist owned by nonroot, so that a fresh volume takes that owner,
# and the base has no shell to mkdir it: the base's nonroot home is an empty
# directory owned by 65532, so it is copied (WORKDIR would not create the
# directory in every builder).
COPY --from=base --chown=65532:65532 /home/nonroot /var/lib/imdedup
ENV IMDEDUP_DATA_DIR=/var/lib/imdedup
USER 65532:65532

# The listen addresses are NOT set here: the binary's defaults are loopback
# (127.0.0.1), so a deployment sets IMDEDUP_{STORAGE,INGEST,GATEWAY}_LISTEN
# and IMDEDUP_ADMIN_LISTEN to 0.0.0.0:<port> per service (the admin variable
# is shared by all three services, whose admin ports differ).
#   7100 gateway WebSocket   7200 ingest gRPC   7300 storage gRPC
#   9100 / 9200 / 9300       admin HTTP (/metrics, /healthz, /readyz)
EXPOSE 7100 7200 7300 9100 9200 9300

ENTRYPOINT ["/usr/local/bin/imdedup"]
CMD ["--help"]

# ---- the image from binaries built on the host -------------------------------
# .dockerignore lets exactly these two files of target/ into the context.
FROM runtime AS image-prebuilt
COPY target/release/imdedup target/release/imdedup-load /usr/local/bin/

# ---- the image, binaries compiled in the builder stage (default) ------------
FROM runtime AS image
COPY --from=builder /out/imdedup /out/imdedup-load /usr/local/bin/
