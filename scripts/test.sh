#!/usr/bin/env bash
# Run every test: the workspace's (unit, integration, plugin tests against the real tracking tools)
# and the out-of-tree vendor example's own suite, built separately as a vendor would.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

bash scripts/setup-libtorch.sh >/dev/null
if [[ -f plugins/trackers/Cargo.toml ]]; then
  VERL_TOOLS_PYTHON=$(bash scripts/setup-python-tools.sh | tail -n 1)
  export VERL_TOOLS_PYTHON
fi

cargo test --workspace --no-fail-fast
# The vendor example shares the target directory the integration tests build it in.
CARGO_TARGET_DIR="$repo/target/vendor-plugin" cargo test --manifest-path examples/vendor-plugin/Cargo.toml
