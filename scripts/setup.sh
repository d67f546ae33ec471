#!/usr/bin/env bash
# Set up everything hpc_verl and its tests need on a fresh Debian/Ubuntu machine:
# system packages (SLURM, munge, podman, shellcheck), a virtualenv with the project
# and its extras. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${HPC_VERL_VENV:-.venv}"
APT_PKGS=(slurm-wlm munge shellcheck podman runc iproute2 procps)

need_apt=()
for pkg in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing system packages: ${need_apt[*]} (run as root or: sudo apt-get install -y ${need_apt[*]})" >&2
    exit 2
  fi
  echo "setup: installing system packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "setup: creating virtualenv $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
"$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q "torch==${HPC_VERL_TORCH_VERSION:-2.13.0}"
"$PY" -m pip install -q -e ".[train,verl,test,tensorboard,wandb,mlflow]"
# Upstream verl is used only for its config files (key validation); its own
# dependency tree (vLLM, flash-attn, ...) is GPU-only, so it comes without deps.
"$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("verl") is None)' || "$PY" -m pip install -q --no-deps "verl==0.9.1"
echo "setup: ready ($("$PY" -c 'import hpc_verl; print("hpc_verl", hpc_verl.__version__)'))"
