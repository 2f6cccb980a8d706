#!/usr/bin/env bash
# Set up verl-core on a fresh machine and run the main job on the embedded default.
#   1. assemble libtorch 2.13.0 (CPU) from PyPI wheels into a cache (skipped when present);
#   2. build the release binary and every bundled plugin;
#   3. install the plugins into target/release/plugins/ (the default plugin directory, next to the
#      binary), mode 644 in a 755 directory, as the loader requires;
#   4. show what was found, then run the main job: the embedded quickstart (`verl-core run`).
# Extra arguments are passed to the main job.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

bash scripts/setup-libtorch.sh >/dev/null
echo "install: building (release)" >&2
cargo build --release --workspace --quiet
bash scripts/bundle-plugins.sh target/release >/dev/null

./target/release/verl-core plugins list
echo >&2
./target/release/verl-core run "$@"
