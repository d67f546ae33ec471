"""Stand-in for ``python -m verl.trainer.main_ppo`` on the SLURM test bed (real verl needs GPUs).

It does what verl 0.9.1's legacy trainer (``trainer.use_v1=false``) does with the
time limit, and nothing else: the driver joins the job's Ray cluster
(``RAY_ADDRESS``) and runs a TaskRunner actor; the actor runs "steps" and after
each one evaluates the capacity-block expiry as verl's ``should_save_ckpt_esi``
does (``os.getenv`` of the variable in the actor's own process; save when
``0 < remaining <= 60 + longest step + trainer.esi_redundant_time``), saving in
verl's layout (``global_step_N/`` then ``latest_checkpointed_iteration.txt``)
when ``trainer.save_freq > 0`` and (last step, every ``save_freq``, or expiry).
``trainer.resume_mode=auto`` resumes from the tracker file. Each step appends
what it saw to ``<default_local_dir>/stub_steps.jsonl`` for the test.

Knob: ``STUB_STEP_S`` (seconds per step, default 1).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

EXPIRY = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"


def overrides(argv: list[str]) -> dict[str, str]:
    out = {}
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep:
            out[key] = value
    return out


def expiry_close(max_step_s: float, redundant_s: float, save_s: float = 60) -> tuple[bool, float | None]:
    ts = os.getenv(EXPIRY)
    if not ts:
        return False, None
    remaining = float(ts) - time.time()
    return remaining > 0 and max_step_s > 0 and remaining <= save_s + max_step_s + redundant_s, remaining


def run(cfg: dict[str, str]) -> int:
    ckpt = Path(cfg["trainer.default_local_dir"])
    ckpt.mkdir(parents=True, exist_ok=True)
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    total = int(cfg.get("trainer.total_training_steps", "10"))
    save_freq = int(cfg.get("trainer.save_freq", "-1"))
    redundant = float(cfg.get("trainer.esi_redundant_time", "0"))
    step_s = float(os.environ.get("STUB_STEP_S", "1"))
    run_no = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    start = 0
    if cfg.get("trainer.resume_mode", "auto") == "auto" and tracker.exists():
        start = int(tracker.read_text())
        print(f"stub-verl: resumed from global_step_{start} (resume_mode=auto)", flush=True)
    longest = 0.0
    log = ckpt / "stub_steps.jsonl"
    for step in range(start + 1, total + 1):
        t0 = time.time()
        time.sleep(step_s)
        longest = max(longest, time.time() - t0)
        close, remaining = expiry_close(longest, redundant)
        saved = save_freq > 0 and (step == total or step % save_freq == 0 or close)
        if saved:
            (ckpt / f"global_step_{step}").mkdir(exist_ok=True)
            tmp = tracker.with_suffix(".tmp")
            tmp.write_text(str(step))
            tmp.replace(tracker)
        with open(log, "a") as fh:
            fh.write(json.dumps({"run": run_no, "step": step, "expiry": os.getenv(EXPIRY), "remaining": remaining,
                                 "close": close, "saved": saved, "pid": os.getpid(),
                                 "resume_mode": cfg.get("trainer.resume_mode")}) + "\n")
        why = " (expiry close: saved)" if close and saved else " (saved)" if saved else ""
        print(f"stub-verl: step {step}/{total}{why}", flush=True)
    return 0


def main() -> int:
    import ray

    cfg = overrides(sys.argv[1:])
    ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"}}, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    class TaskRunner:
        def run(self, cfg: dict[str, str]) -> int:
            return run(cfg)

    rc = ray.get(TaskRunner.remote().run.remote(cfg))
    ray.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
