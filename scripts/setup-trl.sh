#!/usr/bin/env bash
# Build (once) the Python venv that `verl-core bench grpo` drives for its TRL side: PyPI's
# torch 2.13.0 (the libtorch the Rust side links; it runs on CPU-only machines) and trl 1.16.0 with
# its dependencies. Prints the venv's python on stdout (last line); the bench looks for it in the
# same default place (or takes VERL_TRL_PYTHON). CI does not need it: without it the bench prints
# "TRL not available" and times verl-core alone.
#
#   VERL_TRL_DIR  destination (default: ~/.cache/verl-core/trl-venv; the venv is <dir>/venv)
#   PYTHON        interpreter that creates the venv (default: python3)
set -euo pipefail

TRL_VERSION=1.16.0
TORCH_VERSION=2.13.0
dir=${VERL_TRL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/verl-core/trl-venv}
venv=$dir/venv
py=$venv/bin/python
stamp=$venv/.verl-trl-version
want="trl==$TRL_VERSION torch==$TORCH_VERSION"

importable() { "$py" -c 'import torch, trl, transformers' >/dev/null 2>&1; }

if [[ -x "$py" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && importable; then
  echo "$py"
  exit 0
fi

start=$SECONDS
# pip's cache stays inside the cache directory and is removed afterwards: the disk is shared.
export PIP_CACHE_DIR=$dir/pip-cache PIP_DISABLE_PIP_VERSION_CHECK=1
trap 'rm -rf "$PIP_CACHE_DIR"' EXIT
# A half-built venv (no stamp) is rebuilt from scratch, never patched.
rm -rf "$venv"
mkdir -p "$dir"
"${PYTHON:-python3}" -m venv "$venv"
echo "setup-trl: installing torch $TORCH_VERSION and trl $TRL_VERSION into $venv" >&2
"$py" -m pip --quiet install "torch==$TORCH_VERSION" "trl==$TRL_VERSION" >&2

importable || {
  echo "setup-trl: trl does not import from $venv:" >&2
  "$py" -c 'import trl' >&2 || true
  exit 1
}
echo "$want" >"$stamp"
echo "setup-trl: ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))" >&2
echo "$py"
