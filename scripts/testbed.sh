#!/usr/bin/env bash
# The local SLURM test bed (munge, slurmctld, two slurmd with fake GPUs) for people:
#   bash scripts/testbed.sh up|down|status|env|image   (up --nodes N: 1..4 slurmd)
# Directory: $HPC_VERL_TESTBED_DIR or /tmp/hpc_verl-testbed-$UID. After 'up':
#   export SLURM_CONF=<dir>/slurm.conf    (printed by 'up' and 'env')
# The tests start their own test bed (tests/slurm_bed.py) unless HPC_VERL_TESTBED_DIR
# points at a running one, which they then reuse and leave running.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${HPC_VERL_PYTHON:-}"
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m hpc_verl.testbed "${1:-status}" "${@:2}"
