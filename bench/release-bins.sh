# Sourced by the bench scripts: build the release binaries unless
# $1 (the name of the script's no-build variable) is set to 1, and set
# $target_dir to the workspace's target directory.
if [ "${!1:-}" != 1 ]; then
  cargo build --release --locked -q -p imdedup -p imdedup-loadtest
fi
target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null || echo target)
