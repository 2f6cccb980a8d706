#!/usr/bin/env bash
# Create (idempotently) the Python venv holding the real tracking tools the tracker plugin's tests
# run against: mlflow (server), tensorboard (EventAccumulator), trackio (server) and wandb (offline
# run reader). Prints the venv's python on stdout (last line); the tests read it from
# VERL_TOOLS_PYTHON, defaulting to ~/.cache/verl-core/tools-venv/bin/python.
#
#   VERL_TOOLS_VENV   destination (default: ~/.cache/verl-core/tools-venv, outside the checkout so that a
#                     fresh clone (CI) reuses it)
#   PYTHON            interpreter that creates the venv (default: python3, needs >= 3.10)
#
# About 1.1 GB and ~100 s on a fresh machine (measured; only PyPI is needed); instant when up to date.
set -euo pipefail

venv=${VERL_TOOLS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/verl-core/tools-venv}
# Versions the plugin's formats and endpoints were verified against (../shared/DESIGN.md §6).
pins=(mlflow==3.17.2 tensorboard==2.21.0 trackio==0.43.0 wandb==0.31.0)
stamp="$venv/.verl-tools-pins"

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "${pins[*]}" ]]; then
  echo "$venv/bin/python"
  exit 0
fi

start=$SECONDS
"${PYTHON:-python3}" -m venv "$venv"
echo "setup-python-tools: installing ${pins[*]} into $venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}" >&2
# Fail here, not in the tests, when an install is incomplete.
"$venv/bin/python" -c "import mlflow, tensorboard, trackio, wandb" >&2
printf '%s' "${pins[*]}" >"$stamp"
echo "setup-python-tools: done in $((SECONDS - start)) s" >&2
echo "$venv/bin/python"
