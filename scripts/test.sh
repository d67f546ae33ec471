#!/usr/bin/env bash
# The project's test command (README): set up, then run the whole suite.
# Tests start their own services (SLURM test bed, Ray clusters, podman image).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${HPC_VERL_VENV:-.venv}"
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "test: pytest collected no tests" >&2
  exit 1
fi
exit $rc
