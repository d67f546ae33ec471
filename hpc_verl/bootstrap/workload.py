"""A small Ray workload that honours the trainer's preemption contract (tests, demos).

Contract (the PPO trainer follows it too): when SIGUSR2 arrives or ``$HPCV_PREEMPT_FILE``
appears (the batch shell creates it on the preemption signal), finish the current step,
write the checkpoint and exit 99 ("requeue me"); the batch script requeues the job
while SLURM_RESTART_COUNT < slurm.max_restarts, and the next run resumes.

``python -m hpc_verl.bootstrap.workload --steps N [--step-s S] [--out FILE]``:
connects to ``RAY_ADDRESS`` with the job's token, runs one task pinned to every
SLURM node of the job (by its ``hpcv_node_<name>`` resource, one GPU each) and
then N "training steps", checkpointing after each to ``<job_dir>/ckpt.json``
(atomic). On SIGUSR2 it finishes the current step, checkpoints and exits with
:data:`REQUEUE_EXIT` (``errors.REQUEUE_EXIT_CODE``, 99): the contract the PPO
trainer follows too. A restarted
run resumes from the checkpoint. The result goes to ``<job_dir>/result.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from hpc_verl.errors import REQUEUE_EXIT_CODE as REQUEUE_EXIT  # the trainer's contract
from hpc_verl.util.fs import atomic_write_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpc_verl.bootstrap.workload")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument("--job-dir", default=os.environ.get("HPCV_JOB_DIR") or os.environ.get("HPCV_RUN_DIR", "."))
    p.add_argument("--prepare", action="store_true", help="the 'preprocess' stage: note a run, exit")
    p.add_argument("--input", default=None, help="(preprocess) raw data file")
    p.add_argument("--output", default=None, help="(preprocess) output directory")
    args = p.parse_args(argv)
    job_dir = Path(args.job_dir)
    if args.prepare:
        with open(job_dir / "prepared.txt", "a") as fh:
            fh.write(f"prepared in run {os.environ.get('SLURM_RESTART_COUNT', '0')}\n")
        if args.output:
            Path(args.output).mkdir(parents=True, exist_ok=True)
            (Path(args.output) / "train.parquet").write_text("placeholder written by the test workload\n")
        return 0
    preempt_file = os.environ.get("HPCV_PREEMPT_FILE")
    stop = {"asked": False}
    signal.signal(signal.SIGUSR2, lambda *_: stop.__setitem__("asked", True))

    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    nodes = sorted(k[len("hpcv_node_"):] for k in ray.cluster_resources() if k.startswith("hpcv_node_"))

    @ray.remote(num_gpus=1, num_cpus=0)
    def where() -> dict:
        return {"node": os.environ.get("HPC_VERL_RAY_NODE", "?"), "pid": os.getpid(),
                "cuda": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    placed = ray.get([where.options(resources={f"hpcv_node_{n}": 0.01}).remote() for n in nodes])
    ckpt_path = job_dir / "ckpt.json"
    ckpt = json.loads(ckpt_path.read_text()) if ckpt_path.exists() else {"step": 0, "runs": 0}
    start = ckpt["step"]
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    print(f"workload: nodes {nodes}, resumed from step {start}, SLURM_RESTART_COUNT={restart}", flush=True)
    step = start
    while step < args.steps:
        time.sleep(args.step_s)   # one "training step"
        step += 1
        atomic_write_json(ckpt_path, {"step": step, "runs": ckpt["runs"] + 1})
        print(f"workload: step {step}/{args.steps} done", flush=True)
        if preempt_file and os.path.exists(preempt_file):
            stop["asked"] = True  # the launcher's batch shell asks through a file (signals stop at srun)
        if stop["asked"]:
            print(f"workload: SIGUSR2: checkpoint at step {step}, exiting {REQUEUE_EXIT} (requeue me)", flush=True)
            ray.shutdown()
            return REQUEUE_EXIT
    resources = ray.cluster_resources()
    result = {"nodes": nodes, "alive_nodes": len([n for n in ray.nodes() if n["Alive"]]),
              "gpus": resources.get("GPU", 0), "placed": placed, "start_step": start, "final_step": step,
              "restart_count": restart, "ray_address": os.environ["RAY_ADDRESS"]}
    atomic_write_json(job_dir / "result.json", result)
    print(f"workload: done {json.dumps(result)}", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
