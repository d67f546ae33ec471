#!/usr/bin/env bash
# The GPU check: the trainer's roles on one GPU (actor update with FSDP2 and DDP, critic and
# reference forward, the transformers rollout, the colocated weight hand-over, Ulysses SP=1 and
# SP=2), no Ray, no vLLM, no network. Results: OUT_DIR/gpu_check.json.
#
#   bash scripts/gpu_check.sh OUT_DIR [--size 0.5b|tiny] [--device cuda|cpu] [--only CHECK ...]
#
# Needs python3 with torch, transformers and pyyaml (rich optional); PYTHON overrides the
# interpreter. The whole run is stopped after HPC_VERL_GPU_CHECK_TIMEOUT_S (default 540) seconds;
# the JSON keeps every check finished by then.
set -euo pipefail

if [[ $# -lt 1 || $1 == -* ]]; then
  echo "usage: bash scripts/gpu_check.sh OUT_DIR [--size 0.5b|tiny] [--device cuda|cpu] [--only CHECK]" >&2
  exit 2
fi
out_dir=$1
shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python_bin=${PYTHON:-python3}
limit_s=${HPC_VERL_GPU_CHECK_TIMEOUT_S:-540}

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec timeout --signal=TERM --kill-after=20 "$limit_s" "$python_bin" -m hpc_verl.ops.gpu_check "$out_dir" "$@"
