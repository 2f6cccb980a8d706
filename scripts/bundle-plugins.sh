#!/usr/bin/env bash
# Copy the workspace's plugin libraries from a cargo profile directory (e.g. target/release) into
# its plugins/ subdirectory, where the verl-core binary next to it finds them by default.
set -euo pipefail
profile_dir=${1:?usage: bundle-plugins.sh <profile dir, e.g. target/release>}
dest="$profile_dir/plugins"
mkdir -p "$dest"
chmod 755 "$dest"
shopt -s nullglob
found=0
for lib in "$profile_dir"/libverl_plugin_*.so "$profile_dir"/libverl_plugin_*.dylib; do
  install -m 644 "$lib" "$dest/"
  found=$((found + 1))
done
[[ $found -gt 0 ]] || { echo "bundle-plugins: no plugin libraries in $profile_dir (build first)" >&2; exit 1; }
echo "$dest"
