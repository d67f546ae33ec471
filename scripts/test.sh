#!/usr/bin/env bash
# The project's test command (README): set up, then run the whole suite.
# Tests start their own services (SLURM test bed, Ray clusters, podman image).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${HPC_VERL_VENV:-.venv}"
# Two pytest-xdist workers: much of the suite waits on services (SLURM, Ray, podman), so a
# second worker roughly halves the wall time on two cores. Tests on the SLURM test bed stay
# on one worker and start first (tests/conftest.py). HPC_VERL_TEST_WORKERS=0 runs in this one process.
WORKERS="${HPC_VERL_TEST_WORKERS:-2}"
XDIST=()
if [[ "$WORKERS" != 0 ]]; then
  XDIST=(-n "$WORKERS" --dist loadgroup --no-loadscope-reorder)
fi
set +e
"$VENV/bin/python" -m pytest "${XDIST[@]}" "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "test: pytest collected no tests" >&2
  exit 1
fi
exit $rc
