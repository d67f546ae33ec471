#!/usr/bin/env bash
# The README's main-job command: set up, then render the sbatch job for the shipped ib-a100
# profile (8x A100, InfiniBand) and show it, and validate every shipped profile (schema,
# bash -n, shellcheck). Nothing is submitted: this machine has no GPU cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${HPC_VERL_VENV:-.venv}"
HV=("$VENV/bin/hpc-verl")
OUT="${HPC_VERL_DEMO_DIR:-runs/demo}"
mkdir -p "$OUT"

echo "== cluster profiles"
"${HV[@]}" profiles list
echo
echo "== render: profile ib-a100, example job, one trainer override -> $OUT/ib-a100.sbatch"
"${HV[@]}" render --profile ib-a100 --config examples/job_ppo_gsm8k.yaml trainer.total_epochs=2 \
  -o "$OUT/ib-a100.sbatch"
echo
if [[ -t 1 ]]; then
  cat "$OUT/ib-a100.sbatch"
else
  sed -n '1,40p' "$OUT/ib-a100.sbatch"
  echo "... ($(wc -l <"$OUT/ib-a100.sbatch") lines; full script in $OUT/ib-a100.sbatch)"
fi
echo
echo "== validate every profile (schema, bash -n, shellcheck)"
"${HV[@]}" validate --all
echo
echo "demo: done. Submit on a cluster with: sbatch $OUT/ib-a100.sbatch (after mkdir -p jobs)"
