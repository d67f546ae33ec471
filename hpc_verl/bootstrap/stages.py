"""The stages before training, for a job sent to a running Ray cluster (Ray Jobs API).

A batch job runs preprocess and model-check from its script (templates/job.sbatch.j2);
a Ray job has no script, so its driver is ``python -m hpc_verl.bootstrap.stages
--plan JSON -- TRAINER ARGV...``: the same stages with the same commands and the same
skip rules (preprocessed data already there: skipped), then the trainer replaces this
process (``exec``), so Ray sees the trainer's exit status and signals.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Sequence


def _log(msg: str) -> None:
    print(f"[hpc-verl {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


def run_stages(plan: dict[str, Any], python: str = sys.executable) -> int:
    """Preprocess and model-check as the batch script runs them; 0 when both are done or skipped."""
    pre = plan.get("preprocess")
    if not pre:
        _log("stage preprocess: no data.raw in the job config; skipped")
    elif os.path.exists(os.path.join(pre["output"], pre["train_file"])):
        _log(f"stage preprocess: {pre['output']}/{pre['train_file']} already there, skipping")
    else:
        rc = subprocess.call([python, "-m", pre["module"], "--input", pre["input"], "--output", pre["output"],
                              *pre.get("args", [])])
        if rc:
            _log(f"stage preprocess: failed (exit {rc})")
            return rc
        _log("stage preprocess: done")
    model = plan.get("model_check")
    if model:
        rc = subprocess.call([python, "-m", "hpc_verl.launch.checks", "model", model])
        if rc:
            _log(f"stage model-check: failed (exit {rc})")
            return rc
        _log("stage model-check: done")
    else:
        _log("stage model-check: no model.path in the job config (or model.check is false); skipped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: python -m hpc_verl.bootstrap.stages --plan JSON -- TRAINER ARGV...", file=sys.stderr)
        return 2
    cut = args.index("--")
    parser = argparse.ArgumentParser(prog="python -m hpc_verl.bootstrap.stages")
    parser.add_argument("--plan", required=True)
    opts = parser.parse_args(args[:cut])
    trainer = args[cut + 1:]
    rc = run_stages(json.loads(opts.plan))
    if rc:
        return rc
    _log("stage train: " + " ".join(trainer[:3]) + " ...")
    sys.stdout.flush()
    os.execvp(trainer[0], trainer)
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
