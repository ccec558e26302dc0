#!/usr/bin/env bash
# Runs imdedup's whole test suite: builds the workspace and runs every unit
# and integration test. This is the README's test command, and what CI runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "test: cargo is not on PATH; install Rust with rustup first" >&2
  exit 1
fi

cargo test --workspace --locked "$@"
