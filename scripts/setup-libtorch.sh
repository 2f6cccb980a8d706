#!/usr/bin/env bash
# Assemble the libtorch 2.13.0 folder that tch 0.26 needs, from PyPI wheels, into a cache directory.
# Prints the folder on stdout (last line). Skips all work when the folder is already complete.
#
# The folder is linked as <repo>/.libtorch, which .cargo/config.toml hands to torch-sys as LIBTORCH.
#
#   VERL_LIBTORCH_DIR   destination (default: ~/.cache/verl-core/libtorch-2.13.0-<flavour>)
#   VERL_LIBTORCH_FLAVOUR=cpu|cuda
#       cpu  (default) slim CPU-only folder (~490 MB): libtorch_cpu + libc10 + the two CUDA runtime stubs
#            libtorch_cpu.so links against, and a linker script standing in for libtorch.so.
#       cuda the whole wheel's torch/lib (all CUDA libraries) for a machine with NVIDIA GPUs. The CUDA
#            libraries of the nvidia-* wheels must be on the loader path at run time (untested here: no GPU).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
# .cargo/config.toml points LIBTORCH at <repo>/.libtorch, a link to the cached folder.
link_into_repo() { ln -sfn "$1" "$repo/.libtorch"; }

TORCH_VERSION=2.13.0
flavour=${VERL_LIBTORCH_FLAVOUR:-cpu}
dest=${VERL_LIBTORCH_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/verl-core/libtorch-$TORCH_VERSION-$flavour}

if [[ -f "$dest/build-version" && "$(cat "$dest/build-version")" == "$TORCH_VERSION" && -e "$dest/lib/libtorch.so" ]]; then
  link_into_repo "$dest"
  echo "$dest"
  exit 0
fi

case "$flavour" in
  cpu|cuda) ;;
  *) echo "setup-libtorch: VERL_LIBTORCH_FLAVOUR must be cpu or cuda, not '$flavour'" >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "setup-libtorch: downloading torch $TORCH_VERSION wheels (~540 MB) into $work" >&2
"$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$work" \
  "torch==$TORCH_VERSION" nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 >&2

tmp="$dest.partial.$$"
rm -rf "$tmp"
mkdir -p "$tmp/lib" "$tmp/include"
torch_whl=$(ls "$work"/torch-"$TORCH_VERSION"-*.whl)
echo "setup-libtorch: unpacking $(basename "$torch_whl")" >&2
"$python" - "$torch_whl" "$tmp" "$flavour" <<'PY'
import sys, zipfile, os, shutil
whl, dest, flavour = sys.argv[1:4]
keep_cpu = {"libtorch_cpu.so", "libc10.so", "libgomp.so.1"}
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        name = info.filename
        if info.is_dir():
            continue
        if name.startswith("torch/include/"):
            out = os.path.join(dest, "include", name[len("torch/include/"):])
        elif name.startswith("torch/lib/"):
            base = name[len("torch/lib/"):]
            if flavour == "cpu" and base not in keep_cpu:
                continue
            out = os.path.join(dest, "lib", base)
        else:
            continue
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
# libtorch_cpu.so has DT_NEEDED entries for the CUDA runtime and CUPTI even in the CPU build path.
for whl in "$work"/nvidia_cuda_runtime-*.whl "$work"/nvidia_cuda_cupti-*.whl; do
  "$python" - "$whl" "$tmp/lib" <<'PY'
import sys, zipfile, os, shutil
whl, dest = sys.argv[1:3]
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        base = os.path.basename(info.filename)
        if base in ("libcudart.so.13", "libcupti.so.13"):
            with z.open(info) as src, open(os.path.join(dest, base), "wb") as dst:
                shutil.copyfileobj(src, dst)
PY
done
for need in libtorch_cpu.so libc10.so libcudart.so.13 libcupti.so.13; do
  [[ -f "$tmp/lib/$need" ]] || { echo "setup-libtorch: $need missing from the wheels" >&2; exit 1; }
done
if [[ "$flavour" == cpu ]]; then
  # The wheel's real libtorch.so pulls in every CUDA library; link against the CPU part only.
  echo 'INPUT(AS_NEEDED(-ltorch_cpu))' > "$tmp/lib/libtorch.so"
fi
echo "$TORCH_VERSION" > "$tmp/build-version"
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$tmp" "$dest"
link_into_repo "$dest"
echo "setup-libtorch: ready at $dest ($(du -sh "$dest" | cut -f1))" >&2
echo "$dest"
