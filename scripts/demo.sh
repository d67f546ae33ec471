#!/usr/bin/env bash
# The README's main job: set up, then run the whole pipeline on this machine with the `local` profile
# (no SLURM, no container, CPU): preprocess the shipped gsm8k sample -> model check -> Ray up (one
# node) -> five GRPO steps of the built-in trainer on a tiny random model -> collect. Then show the
# run directory (metrics.jsonl, curves.png, a checkpoint) and the metrics summary; last, render the
# sbatch job for the shipped ib-a100 profile and validate every shipped profile (nothing is
# submitted there: this machine has no GPU cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${HPC_VERL_VENV:-.venv}"
HV=("$VENV/bin/hpc-verl")
OUT="${HPC_VERL_DEMO_DIR:-runs/demo}"
export HPC_VERL_HOME="${HPC_VERL_HOME:-$PWD/runs/hpc_verl}"  # the job registry: runs/hpc_verl/jobs/
mkdir -p "$OUT"

echo "== tiny model (models/tiny)"
if [[ -e models/tiny/config.json ]]; then echo "models/tiny already there"; else "${HV[@]}" make-tiny-model models/tiny; fi
echo
echo "== the main job: hpc-verl submit --profile local --config examples/job_local_demo.yaml"
"${HV[@]}" submit --profile local --config examples/job_local_demo.yaml | tee "$OUT/submit.txt"
RUN_DIR=$(sed -n 's/^run directory: //p' "$OUT/submit.txt" | tail -n 1)
echo
echo "== run directory $RUN_DIR"
ls "$RUN_DIR" "$RUN_DIR/checkpoints"
echo
echo "== metrics summary"
"$VENV/bin/python" - "$RUN_DIR/checkpoints/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    print(f"step {r['step']}: reward {r.get('critic/score/mean', 0):.3f}  pg_loss {r.get('actor/pg_loss', 0):+.4f}  "
          f"{r.get('perf/samples_per_s', 0):.1f} samples/s")
PY
echo "plot: $RUN_DIR/checkpoints/curves.png"
echo
echo "== on a cluster: render for the shipped ib-a100 profile -> $OUT/ib-a100.sbatch"
"${HV[@]}" render --profile ib-a100 --config examples/job_ppo_gsm8k.yaml trainer.total_epochs=2 \
  -o "$OUT/ib-a100.sbatch" | tail -n 3
echo "== validate every profile (schema, bash -n, shellcheck)"
"${HV[@]}" validate --all | tail -n 12
echo
echo "demo: done. Jobs: ${HV[*]} list   (registry $HPC_VERL_HOME)"
