#!/usr/bin/env bash
# The local SLURM test bed (munge, slurmctld, two slurmd with fake GPUs) for people:
#   bash scripts/testbed.sh up|down|status|env|image   (up --nodes N: 1..4 slurmd)
# Directory: $HPC_VERL_TESTBED_DIR or /tmp/hpc_verl-testbed-$UID. "up" also builds the node image
# (with the engines when installed), starts the bed's own Docker daemon and writes the bed's profiles
# (testbed-cpu, testbed-cpu-podman, testbed-cpu-docker, ...; up --no-images: SLURM only). After 'up':
#   eval "$(bash scripts/testbed.sh env)"   (exports SLURM_CONF and HPC_VERL_PROFILE_PATH)
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
