#!/usr/bin/env bash
# The README's demo, after set-up:
#  1. the main job: `hpc-verl submit --profile local --config examples/job_local_digits.yaml` runs the whole
#     pipeline on this machine (no SLURM, no container, CPU; Ray up through the same bootstrap as on a
#     cluster) and a tiny random model learns the digit task with the built-in GRPO trainer; the reward
#     curve is drawn in the terminal and written to curves.png, and the demo fails if the mean reward of
#     the last 10 steps is not above 0.8;
#  2. the same pipeline on the shipped gsm8k sample (examples/job_local_demo.yaml, five steps: a random
#     model scores 0 there; this part shows preprocessing and checkpoints of real-world-shaped data);
#  3. the sbatch script for the shipped ib-a100 profile, and every shipped profile validated.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${HPC_VERL_VENV:-.venv}"
HV=("$VENV/bin/hpc-verl")
OUT="${HPC_VERL_DEMO_DIR:-runs/demo}"
export HPC_VERL_HOME="${HPC_VERL_HOME:-$PWD/runs/hpc_verl}"  # the job registry: runs/hpc_verl/jobs/
mkdir -p "$OUT"
run_dir() { sed -n 's/^run directory: //p' "$1" | tail -n 1; }

SECONDS=0
echo "== 1. the main job: a tiny model learns the digit task"
if [[ -e models/tiny/config.json ]]; then echo "models/tiny already there"; else "${HV[@]}" make-tiny-model models/tiny; fi
"${HV[@]}" preprocess digits --output data/digits --skip-existing
echo "hpc-verl submit --profile local --config examples/job_local_digits.yaml"
"${HV[@]}" submit --profile local --config examples/job_local_digits.yaml | tee "$OUT/submit-digits.txt"
RUN_DIR=$(run_dir "$OUT/submit-digits.txt")
echo
# the curve as drawn, with the run it came from (scripts/readme_curve.py puts it into README.md)
"${HV[@]}" plot "$RUN_DIR/checkpoints" --require-final 0.8 | tee "$OUT/curve.txt"
echo "run: bash scripts/demo.sh, commit $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%d), ${SECONDS}s after set-up" >> "$OUT/curve.txt"
echo "part 1 took ${SECONDS}s (model, data, submit, plot)"

echo
echo "== 2. the same pipeline on gsm8k data: hpc-verl submit --profile local --config examples/job_local_demo.yaml"
"${HV[@]}" submit --profile local --config examples/job_local_demo.yaml | tee "$OUT/submit-gsm8k.txt"
RUN_DIR=$(run_dir "$OUT/submit-gsm8k.txt")
echo "run directory $RUN_DIR:"
ls "$RUN_DIR" "$RUN_DIR/checkpoints"

echo
echo "== 3. on a cluster: render for the shipped ib-a100 profile -> $OUT/ib-a100.sbatch"
"${HV[@]}" render --profile ib-a100 --config examples/job_ppo_gsm8k.yaml trainer.total_epochs=2 \
  -o "$OUT/ib-a100.sbatch" | tail -n 3
echo "== validate every profile (schema, bash -n, shellcheck)"
"${HV[@]}" validate --all | tail -n 12
echo
echo "demo: done in ${SECONDS}s. Jobs: ${HV[*]} list   (registry $HPC_VERL_HOME)"
